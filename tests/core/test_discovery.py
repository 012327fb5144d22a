"""hookfit.discovery: plugins found through the entry-point group (classes instantiated, sorted),
replaced by a plugin given to Loop, disabled or restricted by name, and a broken entry point
named.

Distributions are made for real (``make_dist`` in conftest): a ``*.dist-info`` folder with
``METADATA`` and ``entry_points.txt`` on ``sys.path`` is exactly what ``importlib.metadata``
discovers for an installed package (the pip-installed packages have their own end-to-end
tests).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import hookfit
from conftest import BUILTINS, calls, make_dist


def run(**kwargs) -> hookfit.Loop:
    loop = hookfit.Loop(lambda loop, b: None, [0, 1], **kwargs)
    loop.fit()
    return loop


def test_entry_points_are_discovered_sorted_and_classes_instantiated(dists: Path) -> None:
    loop = run()
    names = [name for name, _ in loop.run.pm.list_name_plugin()]
    assert names == ["alpha", "beta"]  # sorted by entry-point name, not file order
    assert type(loop.run.pm.get_plugin("alpha")).__name__ == "Alpha"
    assert loop.run.pm.get_plugin("beta").__name__ == "fake_plugins_mod"
    # pluggy calls the last registered first: beta, then alpha, batch after batch
    assert calls() == [("beta", 0), ("alpha", 0), ("beta", 1), ("alpha", 1)]
    info = loop.run.pm.infos["alpha"]
    assert (info.distribution, info.version, info.source) == ("fake-plugins", "1.2.3", "entry point")


def test_given_plugin_replaces_discovered_one_of_the_same_name(dists: Path) -> None:
    seen = []

    class MyAlpha:
        name = "alpha"

        @hookfit.hookimpl
        def batch_end(self, batch_idx):
            seen.append(batch_idx)

    loop = run(plugins=[MyAlpha()])
    assert [n for n, _ in loop.run.pm.list_name_plugin()] == ["alpha", "beta"]
    assert seen == [0, 1]
    assert ("alpha", 0) not in calls()
    assert loop.run.pm.infos["alpha"].source == "given"


def test_given_plugins_are_called_before_discovered_ones(dists: Path) -> None:
    class Given:
        @hookfit.hookimpl
        def batch_end(self, batch_idx):
            calls().append(("given", batch_idx))

    run(plugins=[Given()])
    assert calls()[:3] == [("given", 0), ("beta", 0), ("alpha", 0)]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_disable_by_name(dists: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "argument":
        loop = run(disable=["alpha"])
    else:
        monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", f"{BUILTINS}, alpha")
        loop = run()
    assert [n for n, _ in loop.run.pm.list_name_plugin()] == ["beta"]
    assert loop.run.pm.infos["alpha"].enabled is False
    assert {name for name, _ in calls()} == {"beta"}


def test_restrict_to_a_list(dists: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "alpha")
    loop = run()
    assert [n for n, _ in loop.run.pm.list_name_plugin()] == ["alpha"]
    monkeypatch.setenv("HOOKFIT_PLUGINS", "")
    assert hookfit.Loop(lambda l, b: None, [1]).fit() and calls() == [("alpha", 0), ("alpha", 1)]


class Mine:
    """A plugin given in code, with options a table of the file could name."""

    name = "mine"

    def __init__(self, level: int = 0) -> None:
        self.batches: list[int] = []

    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        self.batches.append(batch_idx)


@pytest.mark.parametrize("how", ["environment", "file"])
def test_the_environment_or_the_file_drops_a_given_plugin_with_a_warning_naming_both(
        dists: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The operator's switch, outside the script, wins over the script: the plugin given to Loop
    does not run, and one warning names it and what disabled it; the file's table for it is
    said to be unused because of that, never because the given plugin won over it."""
    table = "[plugins.mine]\nlevel = 2\n" + ("enabled = false\n" if how == "file" else "")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "run.toml"))
    (tmp_path / "run.toml").write_text(table)
    if how == "environment":
        monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", f"{BUILTINS},mine")
    mine = Mine()
    with pytest.warns(hookfit.HookfitWarning) as caught:
        loop = run(plugins=[mine])
    said = [str(w.message) for w in caught]
    off = (f"HOOKFIT_DISABLE_PLUGINS={BUILTINS},mine disables it; {tmp_path / 'run.toml'} [plugins.mine] is not "
           "used either" if how == "environment" else f"{tmp_path / 'run.toml'} [plugins.mine] enabled = false "
           "disables it")
    assert said == [f"plugin 'mine' ({__name__}.Mine, given to Loop) does not run: {off}"], said
    assert mine.batches == [] and loop.run.pm.get_plugin("mine") is None
    assert loop.run.pm.infos["mine"].enabled is False and loop.run.pm.infos["mine"].disabled_by in off


def test_restricting_to_a_list_never_drops_a_given_plugin(dists: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "")
    mine = Mine()
    run(plugins=[mine])
    assert mine.batches == [0, 1] and "fake_plugins_mod" not in sys.modules  # the discovered ones never load


@pytest.mark.bad_input
def test_a_plugin_both_given_and_disabled_in_one_call_is_refused(dists: Path) -> None:
    mine = Mine()
    with pytest.raises(hookfit.PluginError, match=rf"Loop\(disable=\[...\]\) names 'mine', and the plugin "
                       rf"{__name__}.Mine given to Loop\(plugins=\[...\]\) is named 'mine': leave it out of "
                       r"plugins=\[...\] or out of disable=\[...\] \(to switch it off without editing the script: "
                       r"HOOKFIT_DISABLE_PLUGINS=mine\)"):
        run(plugins=[mine], disable=["mine"])
    assert mine.batches == []


@pytest.mark.bad_input
def test_unknown_name_in_disable_warns_with_suggestion(dists: Path) -> None:
    with pytest.warns(hookfit.HookfitWarning, match=r"'alfa' \(disabled\).*did you mean 'alpha'"):
        run(disable=["alfa"])


@pytest.mark.fault
def test_broken_entry_point_fails_naming_it_and_can_be_disabled(dists: Path, tmp_path: Path) -> None:
    make_dist(tmp_path / "broken", "broken-plugin", {"broken": "does_not_exist_mod"}, {})
    sys.path.insert(0, str(tmp_path / "broken"))
    try:
        with pytest.raises(hookfit.PluginError) as info:
            run()
        message = str(info.value)
        assert "'broken'" in message and "broken-plugin 1.2.3" in message
        assert "does_not_exist_mod" in message and "HOOKFIT_DISABLE_PLUGINS=broken" in message
        assert isinstance(info.value.__cause__, ModuleNotFoundError)
        assert run(disable=["broken"]).state.status == "completed"
    finally:
        sys.path.remove(str(tmp_path / "broken"))


def test_a_given_instance_of_the_class_an_entry_point_names_replaces_the_discovered_one(dists: Path) -> None:
    """``Alpha`` has no ``name``: an instance given to configure it takes the name of the entry
    point that names its class, instead of running beside the discovered one as 'Alpha'."""
    import fake_plugins_mod

    given = fake_plugins_mod.Alpha()
    loop = run(plugins=[given])
    assert [n for n, _ in loop.run.pm.list_name_plugin()] == ["alpha", "beta"]
    assert loop.run.pm.get_plugin("alpha") is given and loop.run.pm.infos["alpha"].source == "given"
    assert calls() == [("beta", 0), ("alpha", 0), ("beta", 1), ("alpha", 1)]  # once each, in its place
    loop = run(plugins=[fake_plugins_mod])  # a module entry point: the module itself given
    assert [n for n, _ in loop.run.pm.list_name_plugin()] == ["alpha", "beta"]
    assert loop.run.pm.infos["beta"].source == "given"


INSTANCES = """
    import hookfit

    class Counter:
        def __init__(self, tag="discovered"):
            self.tag = tag

        @hookfit.hookimpl
        def fit_end(self, loop):
            TAGS.append(self.tag)

    TAGS = []
    INSTANCE = Counter(tag="instance")
    """


def test_a_given_object_takes_the_name_of_the_entry_point_naming_it_before_its_class(
        dists: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``counter`` names the class, ``counter_inst`` an instance of it: the instance itself given
    replaces ``counter_inst``, another instance of the class replaces ``counter``. An entry point
    whose module is not imported is never imported to name a given plugin."""
    make_dist(tmp_path / "more", "counters", {"counter": "counters_mod:Counter", "counter_inst": "counters_mod:INSTANCE",
                                               "unimported": "never_imported_mod"},
              {"counters_mod": INSTANCES, "never_imported_mod": "raise RuntimeError('imported')"})
    monkeypatch.syspath_prepend(str(tmp_path / "more"))
    hookfit.discovery.refresh()
    try:
        import counters_mod

        for given, replaced, ran in ((counters_mod.INSTANCE, "counter_inst", ["discovered", "instance"]),
                                     (counters_mod.Counter(tag="given"), "counter", ["given", "instance"])):
            counters_mod.TAGS.clear()
            loop = run(plugins=[given], disable=["unimported"])
            assert loop.run.pm.get_plugin(replaced) is given and "Counter" not in loop.run.pm.infos
            assert sorted(counters_mod.TAGS) == ran
        assert "never_imported_mod" not in sys.modules
    finally:
        sys.modules.pop("counters_mod", None)
        hookfit.discovery.refresh()


def test_inert_asks_the_run_of_a_plugin_whose_method_takes_it() -> None:
    """hookfit plugins asks inert(chosen); a run asks before its configure with itself too,
    which a method with a second parameter is given and one with a single parameter is not."""
    from hookfit.discovery import inert

    class Alone:
        def inert(self, chosen):
            return None if chosen else "chosen"

    class WithRun:
        def inert(self, chosen, loop=None):
            return None if loop == "smoke run" else f"asked by {loop}"

    run = "smoke run"
    assert (inert(Alone(), False), inert(Alone(), False, run), inert(Alone(), True, run)) == ("chosen", "chosen", None)
    assert (inert(WithRun(), False), inert(WithRun(), False, run)) == ("asked by None", None)
    assert inert(object(), False, run) is None  # no method: it takes part


def test_the_options_listed_are_the_object_s_own_when_hookfit_did_not_build_it(
        dists: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hookfit plugins`` lists each plugin's options: for a class an entry point names, those it
    was built with (the file's or the defaults); for an instance an entry point or Loop gives,
    the instance's own, not its class's defaults."""
    from hookfit import config, discovery

    make_dist(tmp_path / "more", "counters", {"counter": "counters_mod:Counter", "counter_inst": "counters_mod:INSTANCE"},
              {"counters_mod": INSTANCES})
    monkeypatch.syspath_prepend(str(tmp_path / "more"))
    discovery.refresh()
    try:
        infos = {i.name: i for i in discovery.collect(strict=False, configured=config.Config())}
        listed = {name: config.options_of(infos[name].plugin, infos[name].options, infos[name].built)
                  for name in ("counter", "counter_inst")}
        assert listed == {"counter": {"tag": ("discovered", "default")}, "counter_inst": {"tag": ("instance", "object")}}
        import counters_mod

        [given] = [i for i in discovery.collect([counters_mod.Counter(tag="given")], strict=False,
                                                configured=config.Config()) if i.source == "given"]
        assert config.options_of(given.plugin, given.options, given.built) == {"tag": ("given", "object")}
    finally:
        sys.modules.pop("counters_mod", None)
        discovery.refresh()
