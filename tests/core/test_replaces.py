"""hookfit.discovery: a distribution replaces another's plugin on purpose by naming it in its
``hookfit.replaces`` entry points; an undeclared clash of names still warns. Distributions are
made for real (``make_dist`` in conftest: a ``*.dist-info`` folder on ``sys.path``)."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

import hookfit
from conftest import make_dist


def run(**kwargs) -> hookfit.Loop:
    loop = hookfit.Loop(lambda loop, b: None, [0, 1], **kwargs)
    loop.fit()
    return loop


SAVER = """
    import hookfit

    class Saver:
        @hookfit.hookimpl
        def after_epoch(self, loop, epoch):
            pass
    """


def checkpoint_dist(site: Path, dist: str, module: str, replaces: str | None) -> None:
    """A distribution whose entry point ``checkpoint`` is ``module:Saver``, declaring in
    ``hookfit.replaces`` that it replaces the ``checkpoint`` of ``replaces`` (when given)."""
    make_dist(site, dist, {"checkpoint": f"{module}:Saver"}, {module: SAVER})
    if replaces is not None:
        listed = site / f"{dist.replace('-', '_')}-1.2.3.dist-info" / "entry_points.txt"
        listed.write_text(listed.read_text() + f"\n[hookfit.replaces]\ncheckpoint = {replaces}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A folder at the end of ``sys.path`` (after hookfit's own) for distributions."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])
    monkeypatch.setenv("HOOKFIT_PLUGINS", "checkpoint")
    hookfit.discovery.refresh()
    yield folder
    for module in ("my_ckpt_mod", "stray_ckpt_mod"):
        sys.modules.pop(module, None)
    hookfit.discovery.refresh()


@pytest.mark.parametrize("spelled", ["hookfit", "Hookfit"])
def test_a_distribution_that_declares_it_replaces_a_builtin_wins_without_a_warning(site: Path, spelled: str) -> None:
    """After hookfit's own on ``sys.path``: the declaration, not the path's order, chooses."""
    checkpoint_dist(site, "my-checkpoint", "my_ckpt_mod", replaces=spelled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop = run()
    info = loop.run.pm.infos["checkpoint"]
    assert info.distribution == "my-checkpoint" and type(info.plugin).__module__ == "my_ckpt_mod"
    assert info.replaces is not None and info.replaces.startswith("hookfit ")
    assert info.replaces.endswith("(hookfit.plugins.checkpoint:Checkpoint)")


@pytest.mark.parametrize("declared", [None, "some-other-dist"])
def test_an_undeclared_clash_of_names_still_warns(site: Path, declared: str | None) -> None:
    checkpoint_dist(site, "stray-checkpoint", "stray_ckpt_mod", replaces=declared)
    with pytest.warns(hookfit.HookfitWarning, match="two distributions register the hookfit plugin 'checkpoint'.*"
                      "stray-checkpoint.*uninstall one.*hookfit.replaces"):
        loop = run()
    assert loop.run.pm.infos["checkpoint"].replaces is None


def test_a_declared_replacement_silences_only_its_own_pair(site: Path) -> None:
    checkpoint_dist(site, "my-checkpoint", "my_ckpt_mod", replaces="hookfit")
    checkpoint_dist(site / "more", "stray-checkpoint", "stray_ckpt_mod", replaces=None)
    sys.path.append(str(site / "more"))
    hookfit.discovery.refresh()
    with pytest.warns(hookfit.HookfitWarning) as caught:
        loop = run()
    clashes = [str(w.message) for w in caught if "two distributions" in str(w.message)]
    assert len(clashes) == 1 and "my-checkpoint" in clashes[0] and "stray-checkpoint (stray_ckpt_mod:Saver, ignored)" in clashes[0]
    assert loop.run.pm.infos["checkpoint"].distribution == "my-checkpoint"


@pytest.mark.bad_input
def test_two_replacements_of_one_builtin_are_told_how_to_choose(site: Path) -> None:
    """Both declared what the clash warning would advise: it says to choose one instead, and
    the instance a script gives is the plugin the run uses."""
    checkpoint_dist(site, "my-checkpoint", "my_ckpt_mod", replaces="hookfit")
    checkpoint_dist(site / "more", "stray-checkpoint", "stray_ckpt_mod", replaces="hookfit")
    sys.path.append(str(site / "more"))
    hookfit.discovery.refresh()
    with pytest.warns(hookfit.HookfitWarning) as caught:
        run()
    clashes = [str(w.message) for w in caught if "two distributions" in str(w.message)]
    assert len(clashes) == 1 and "both replace hookfit's on purpose: uninstall one, or give the one to use" in clashes[0]
    assert "entry points" not in clashes[0]
    chosen = importlib.import_module("stray_ckpt_mod").Saver()  # the one ignored, chosen
    loop = run(plugins=[chosen])  # (the clash was said once, when the entry points were read)
    assert loop.run.pm.infos["checkpoint"].plugin is chosen


def test_the_clash_warning_names_the_declared_replacement_that_is_used(site: Path) -> None:
    """The undeclared distribution sits between hookfit and the declared replacement on
    ``sys.path``: the replacement is used, and the warning says so, not hookfit's built-in."""
    checkpoint_dist(site, "stray-checkpoint", "stray_ckpt_mod", replaces=None)
    checkpoint_dist(site / "more", "my-checkpoint", "my_ckpt_mod", replaces="hookfit")
    sys.path.append(str(site / "more"))
    hookfit.discovery.refresh()
    with pytest.warns(hookfit.HookfitWarning) as caught:
        loop = run()
    clashes = [str(w.message) for w in caught if "two distributions" in str(w.message)]
    assert len(clashes) == 1, clashes
    assert "my-checkpoint (my_ckpt_mod:Saver, used)" in clashes[0]
    assert "stray-checkpoint (stray_ckpt_mod:Saver, ignored)" in clashes[0]
    assert "hookfit.plugins.checkpoint" not in clashes[0]
    info = loop.run.pm.infos["checkpoint"]
    assert info.distribution == "my-checkpoint" and type(info.plugin).__module__ == "my_ckpt_mod"
