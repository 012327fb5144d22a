"""hookfit.clashes: of several distributions' entry points of one plugin name, which one a run
uses, and the warning naming it, whatever the order on ``sys.path``."""

from __future__ import annotations

import importlib.metadata as metadata
import itertools
import warnings

import pytest

from hookfit.clashes import Found, canonical, choose
from hookfit.errors import HookfitWarning


def found(distribution: str) -> Found:
    return Found(metadata.EntryPoint("console", f"{distribution.replace('-', '_')}:Console", "hookfit"),
                 distribution, "1.0", None)


REPLACEMENTS = frozenset({(canonical("plain-console"), "console", canonical("hookfit"))})


def chosen(order: tuple[str, ...]) -> tuple[Found, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        used = choose("console", [found(name) for name in order], REPLACEMENTS)
    assert all(w.category is HookfitWarning for w in caught)
    return used, [str(w.message) for w in caught]


@pytest.mark.parametrize("order", list(itertools.permutations(["hookfit", "plain-console", "stray-console"])))
def test_the_warning_names_the_plugin_used_whatever_the_order(order: tuple[str, ...]) -> None:
    """The declared replacement stands at hookfit's place if that is earlier than its own; the
    undeclared third distribution clashes with it, and the first of the two wins."""
    used, said = chosen(order)
    first = min(order.index("plain-console"), order.index("hookfit"))
    assert used.distribution == ("stray-console" if order.index("stray-console") < first else "plain-console")
    ignored = ({"plain-console", "stray-console"} - {used.distribution}).pop()
    assert len(said) == 1, said
    assert f"{used.distribution} ({used.ep.value}, used)" in said[0]
    assert f"{ignored} ({found(ignored).ep.value}, ignored)" in said[0]
    assert "hookfit (" not in said[0]  # replaced on purpose: no clash of its own


@pytest.mark.parametrize("order", [("hookfit", "plain-console"), ("plain-console", "hookfit")])
def test_a_declared_replacement_wins_silently_and_says_what_it_replaced(order: tuple[str, ...]) -> None:
    used, said = chosen(order)
    assert said == [] and used.distribution == "plain-console"
    assert used.replaces == "hookfit 1.0 (hookfit:Console)"


def test_one_distribution_found_twice_counts_once() -> None:
    used, said = chosen(("stray-console", "stray-console"))
    assert said == [] and used.distribution == "stray-console" and used.replaces is None
