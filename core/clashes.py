"""Which entry point a run uses when several distributions register one hookfit plugin name,
and the warning that names the one used and each one ignored (the rule is
:func:`hookfit.discovery.entry_points`'s)."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import warnings
from collections.abc import Sequence
from typing import NamedTuple

from hookfit.errors import HookfitWarning, user_level

REPLACES = "hookfit.replaces"
"""The entry-point group in which a distribution says which plugins of another distribution its
own plugins replace on purpose (see :func:`hookfit.discovery.entry_points`)."""

Replacement = tuple[str | None, str, str | None]
"""``(distribution, plugin, distribution replaced)``, both names :func:`canonical`: one entry of
a distribution's ``hookfit.replaces`` group."""


class Found(NamedTuple):
    ep: metadata.EntryPoint
    distribution: str | None
    version: str | None
    replaces: str | None  # the other distribution's plugin this one replaces on purpose


def canonical(distribution: str | None) -> str | None:
    """A distribution's name as packaging compares names: lower case, ``-`` for runs of ``-_.``."""
    return None if distribution is None else re.sub(r"[-_.]+", "-", distribution).lower()


def choose(name: str, found: Sequence[Found], replacements: frozenset[Replacement]) -> Found:
    """The entry point named ``name`` that a run uses, of ``found`` (in ``sys.path`` order, one
    distribution's found twice counting once, at its first place, as for imports).

    A distribution that replaces another's plugin on purpose takes that plugin's place: the
    replaced one is left out without a word, and the replacement stands on ``sys.path`` at the
    earlier of its own place and the place of what it replaces. Of those left, the first wins;
    each other one is a clash, and gets a :class:`HookfitWarning` naming the one used and the one
    ignored. The winner's :attr:`Found.replaces` describes the plugin it replaced, if any."""
    ones: list[Found] = []
    for entry in found:
        if all(entry.distribution != one.distribution for one in ones):
            ones.append(entry)
    keys = [canonical(one.distribution) for one in ones]
    replaced = [[j for j, theirs in enumerate(keys) if j != i and (mine, name, theirs) in replacements]
                for i, mine in enumerate(keys)]
    left = [i for i in range(len(ones)) if not any(i in them for them in replaced)] or list(range(len(ones)))

    def place(i: int) -> int:
        reached, todo = {i}, [i]
        while todo:  # what it replaces, what that replaces...; a cycle ends where it began
            todo = [j for k in todo for j in replaced[k] if j not in reached]
            reached.update(todo)
        return min(reached)

    winner = min(left, key=lambda i: (place(i), i))
    used = ones[winner]
    for i in left:
        if i != winner:
            both = [ones[j].distribution for j in sorted(set(replaced[winner]) & set(replaced[i]))]
            how = (f"both replace {both[0]}'s on purpose: uninstall one, or give the one to use as an instance "
                   f"in the script's plugins=[...]" if both else
                   f"uninstall one, or, to replace the plugin on purpose, declare it in the replacing "
                   f"distribution's {REPLACES!r} entry points ({name} = \"<distribution replaced>\")")
            warnings.warn(
                f"two distributions register the hookfit plugin {name!r}: "
                f"{used.distribution} ({used.ep.value}, used) and {ones[i].distribution} ({ones[i].ep.value}, "
                f"ignored); {how}", HookfitWarning, stacklevel=user_level())
    if replaced[winner]:
        first = ones[replaced[winner][0]]
        return used._replace(replaces=f"{first.distribution} {first.version} ({first.ep.value})")
    return used
