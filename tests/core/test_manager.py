"""hookfit.manager: validation of what plugins implement, the events plugins declare for each
other, names of plugins as the user knows them (discovery itself, and how its distributions
are made for real: test_discovery.py)."""

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


@pytest.mark.bad_input
def test_misspelt_hook_fails_at_fit_before_any_batch() -> None:
    steps = []

    class Typo:
        name = "typo"

        @hookfit.hookimpl
        def batch_ned(self, loop):
            pass

    loop = hookfit.Loop(lambda loop, b: steps.append(b), [1], plugins=[Typo()])
    with pytest.raises(hookfit.PluginError) as info:
        loop.fit()
    message = str(info.value)
    assert "plugin 'typo'" in message and "'batch_ned'" in message and "Did you mean 'batch_end'" in message
    assert "optionalhook" not in message  # a misspelt name is not to be silenced
    assert steps == [] and loop.state.status == "idle"


@pytest.mark.bad_input
def test_a_listener_of_an_event_no_plugin_of_the_run_declares_is_told_of_optionalhook() -> None:
    """Another package's event (its plugin uninstalled, or disabled: never imported, its declarations
    absent): the error says how a listener stays valid in a run without it."""
    class Listens:
        name = "listens"

        @hookfit.hookimpl
        def plateau_stalled(self, loop):
            pass

    with pytest.raises(hookfit.PluginError, match=r"plugin 'listens'.*'plateau_stalled', which is not a hookfit event"
                                                  r".*@hookfit.hookimpl\(optionalhook=True\)"):
        hookfit.Loop(lambda loop, b: None, [1], plugins=[Listens()]).fit()


@pytest.mark.bad_input
def test_wrong_argument_name_fails_naming_plugin_and_hook() -> None:
    class Wrong:
        name = "wrong"

        @hookfit.hookimpl
        def batch_end(self, loop, outptu):
            pass

    with pytest.raises(hookfit.PluginError, match=r"plugin 'wrong'.*batch_end.*outptu") as caught:
        hookfit.Loop(lambda loop, b: None, [1], plugins=[Wrong()]).fit()
    assert ("The event batch_end(loop, output, batch, batch_idx) gives no 'outptu'; did you mean 'output'?"
            in str(caught.value))  # the event's arguments, not only pluggy's "can not be found in the hookspec"


@pytest.mark.bad_input
def test_the_argument_hint_is_of_the_implementation_pluggy_refused() -> None:
    """Another hook taking *args/**kwargs was named instead (its 'args'), and a name with no close one
    ran into the next sentence."""

    class Two:
        name = "two"

        @hookfit.hookimpl
        def batch_end(self, loop, *args, **kwargs):
            pass

        @hookfit.hookimpl
        def fit_end(self, xyz):
            pass

    with pytest.raises(hookfit.PluginError) as caught:
        hookfit.Loop(lambda loop, b: None, [1], plugins=[Two()]).fit()
    assert "The event fit_end(loop) gives no 'xyz'. An implementation takes" in str(caught.value)


@pytest.mark.bad_input
def test_an_optional_implementation_named_close_to_an_event_is_warned_about() -> None:
    """optionalhook=True (for another plugin's events) skipped the misspelt-hook check: `epoch_ends`
    was never called, without a word."""

    class Typo:
        name = "typo"

        @hookfit.hookimpl(optionalhook=True)
        def epoch_ends(self):
            pass

    with pytest.warns(hookfit.HookfitWarning, match=r"plugin 'typo'.*'epoch_ends'.*no plugin of this run declares.*"
                                                    r"Did you mean 'epoch_end'\?"):
        assert hookfit.Loop(lambda loop, b: None, [1], plugins=[Typo()]).fit().status == "completed"


def test_optional_hook_for_an_absent_event_is_allowed() -> None:
    class Consumer:
        @hookfit.hookimpl(optionalhook=True)
        def some_other_plugins_event(self):
            pass

    assert hookfit.Loop(lambda loop, b: None, [1], plugins=[Consumer()]).fit().status == "completed"


@pytest.mark.bad_input
def test_two_given_plugins_with_one_name() -> None:
    class P:
        name = "same"

    with pytest.raises(hookfit.PluginError, match="both named 'same'"):
        hookfit.Loop(lambda loop, b: None, [1], plugins=[P(), P()]).fit()

# -- events plugins declare for each other -----------------------------------------------

class SampleEvents:
    @hookfit.hookspec
    def samples_generated(self, loop, images):
        """A GAN plugin produced sample images."""


class Sampler:
    name = "sampler"
    hookspecs = SampleEvents

    @hookfit.hookimpl
    def epoch_end(self, loop):
        if (call := loop.hooks.samples_generated) is not None:
            call(loop, ["image"])


class Gallery:
    name = "gallery"

    def __init__(self) -> None:
        self.received = []

    @hookfit.hookimpl(optionalhook=True)
    def samples_generated(self, images):
        self.received.append(images)


def test_a_plugin_declares_events_for_others() -> None:
    gallery = Gallery()  # registered before the declaring plugin: still checked and called
    hookfit.Loop(lambda l, b: None, [1], max_epochs=2, plugins=[gallery, Sampler()]).fit()
    assert gallery.received == [["image"], ["image"]]


def test_a_consumer_works_without_the_declaring_plugin() -> None:
    gallery = Gallery()
    assert hookfit.Loop(lambda l, b: None, [1], plugins=[gallery]).fit().status == "completed"
    assert gallery.received == []


@pytest.mark.bad_input
def test_a_misspelt_declared_event_is_still_caught() -> None:
    class Typo:
        name = "typo"

        @hookfit.hookimpl
        def samples_generatd(self, images):
            pass

    with pytest.raises(hookfit.PluginError, match="Did you mean 'samples_generated'"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Sampler(), Typo()]).fit()


# -- the events the built-in plugins declare are always declared ------------------------------

class Listener:
    """A consumer of the metrics plugin's event, not marked optional: it relies on the event
    being declared."""

    name = "listener"

    def __init__(self) -> None:
        self.heard = []

    @hookfit.hookimpl
    def metrics_update(self, stage, metrics):
        self.heard.append((stage, metrics))


class Publisher:
    """A metrics replacement of another package: it fires the metrics plugin's event and
    declares nothing itself."""

    def __init__(self, name: str) -> None:
        self.name = name

    @hookfit.hookimpl
    def batch_end(self, loop, batch_idx):
        if (call := loop.hooks.metrics_update) is not None:
            call(loop, "train", f"snapshot {batch_idx}")


@pytest.mark.parametrize("how", ["disabled", "not listed", "replaced"])
def test_a_builtin_plugins_events_are_declared_whether_it_is_enabled_or_not(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """metrics_update is the metrics plugin's: a replacement fires it and a consumer hears it
    when the built-in is disabled, left out of HOOKFIT_PLUGINS or replaced by name."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "" if how == "not listed" else "metrics")
    listener = Listener()
    publisher = Publisher("metrics" if how == "replaced" else "mean_metrics")
    loop = run(plugins=[listener, publisher], disable=["metrics"] if how == "disabled" else [])
    assert listener.heard == [("train", "snapshot 0"), ("train", "snapshot 1")]
    pm = loop.run.pm
    assert pm.get_plugin("metrics") is (publisher if how == "replaced" else None)
    assert [name for name, _ in pm.declared if name == "metrics"] == ["metrics"]  # added once
    assert pm.hook.metrics_update.has_spec()


@pytest.mark.bad_input
def test_a_misspelt_builtin_event_is_caught_with_the_plugin_disabled() -> None:
    class Typo:
        name = "typo"

        @hookfit.hookimpl
        def metrics_updat(self, metrics):
            pass

    with pytest.raises(hookfit.PluginError, match="Did you mean 'metrics_update'"):
        run(plugins=[Typo()], disable=["metrics"])


def test_a_disabled_plugin_that_fails_to_import_declares_nothing_and_fails_nothing(
        dists: Path, tmp_path: Path) -> None:
    """A disabled plugin is never imported: a broken one stays what disabling it makes it, the
    way around a broken plugin."""
    make_dist(tmp_path / "broken", "broken-plugin", {"broken": "does_not_exist_mod"}, {})
    sys.path.insert(0, str(tmp_path / "broken"))
    try:
        loop = run(disable=["broken"])
        assert loop.state.status == "completed"
        assert loop.run.pm.infos["broken"].error is None
    finally:
        sys.path.remove(str(tmp_path / "broken"))


def test_a_distribution_shadowing_a_builtin_name_keeps_the_builtins_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package registering the entry point ``checkpoint`` wins over the built-in (with one
    warning naming both), and the built-in's declared events (``checkpoint_saved``, which the
    dashboard implements) are still added, so runs work and the replacement can announce."""
    heard = []

    class Listener:
        name = "listener"

        @hookfit.hookimpl
        def checkpoint_saved(self, path):
            heard.append(path)

    make_dist(tmp_path / "site", "other-checkpoint", {"checkpoint": "other_ckpt_mod:Saver"}, {"other_ckpt_mod": """
        import hookfit

        class Saver:
            @hookfit.hookimpl
            def after_epoch(self, loop, epoch):
                loop.hooks.checkpoint_saved(loop, f"saved-{epoch}", "epoch", loop.state.step)
        """})
    sys.path.insert(0, str(tmp_path / "site"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "checkpoint,tui")  # tui implements checkpoint_saved too
    hookfit.discovery.refresh()
    try:
        with pytest.warns(hookfit.HookfitWarning, match="two distributions register the hookfit plugin 'checkpoint'"):
            loop = run(plugins=[Listener()])
        assert loop.state.status == "completed"
        assert loop.run.pm.infos["checkpoint"].distribution == "other-checkpoint"
        assert heard == ["saved-0"]
    finally:
        sys.path.remove(str(tmp_path / "site"))
        sys.modules.pop("other_ckpt_mod", None)
        hookfit.discovery.refresh()


def test_participants_are_the_plugins_as_the_user_knows_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enabled and registered plugins, in order; not a disabled one (given, and switched off by
    the environment), not one that switched itself off, not a helper a plugin registered for itself."""
    class Helper:
        @hookfit.hookimpl
        def batch_end(self):
            pass

    class Owner:
        name = "owner"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.pm.register(Helper(), name="owner.helper")

    class Leaving:
        name = "leaving"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.pm.unregister(self)

    class Off:
        name = "off"

    seen = []

    class Look:
        name = "look"

        @hookfit.hookimpl
        def fit_start(self, loop):
            seen.append(loop.pm.participants())

    monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", "off")
    with pytest.warns(hookfit.HookfitWarning, match=r"plugin 'off' \(.*given to Loop\) does not run: "
                      r"HOOKFIT_DISABLE_PLUGINS=off disables it"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Owner(), Leaving(), Off(), Look()]).fit()
    assert seen == [["owner", "look"]]


def test_an_observer_given_to_loop_is_named_with_its_distribution(tmp_path: Path) -> None:
    """A plugin object given to Loop from an installed package is named, in the observer's
    warning, by its distribution and version, as a discovered plugin is (not by its class
    alone)."""
    site = make_dist(tmp_path / "site", "watch-things", {}, {"watch_things_mod": """
        import hookfit

        class Watcher:
            name = "watcher"
            observer = True

            @hookfit.hookimpl
            def batch_end(self):
                raise OSError("screen gone")
        """})
    (next(site.glob("*.dist-info")) / "top_level.txt").write_text("watch_things_mod\n")
    sys.path.insert(0, str(site))
    hookfit.discovery.refresh()
    try:
        from watch_things_mod import Watcher

        with pytest.warns(hookfit.ObserverWarning, match=r"plugin 'watcher' \(watch-things 1\.2\.3, "
                                                         r"watch_things_mod\.Watcher, given to Loop\)"):
            run(plugins=[Watcher()])
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("watch_things_mod", None)
        hookfit.discovery.refresh()



@pytest.mark.bad_input
def test_a_method_named_for_an_event_without_the_marker_is_warned_about_at_the_fit_line() -> None:
    """A plugin whose ``batch_end`` lacks ``@hookfit.hookimpl`` is never called by pluggy and
    nothing fails: one warning names the plugin and each such method, pointing at the script's
    ``fit()`` line; marked methods, other methods and attributes named like events are not
    named."""
    import warnings

    class Forgetful:
        name = "forgetful"
        results = None  # an attribute, not a method: not named

        def batch_end(self, loop):
            raise AssertionError("never called")

        def fit_end(self, loop):
            raise AssertionError("never called")

        def batch_ends(self, loop):  # named for no event
            return None

        @hookfit.hookimpl
        def fit_start(self, loop):
            return None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(lambda loop, batch: None, [1, 2], plugins=[Forgetful()]).fit()
    said = [w for w in caught if "not marked" in str(w.message)]
    assert len(said) == 1 and str(said[0].message).startswith("plugin 'forgetful' ("), said
    assert str(said[0].message).endswith(
        "given to Loop) has methods named for events and not marked @hookfit.hookimpl, so hookfit never calls "
        "them: batch_end, fit_end; mark them, or rename them"), said[0].message
    assert said[0].category is hookfit.HookfitWarning and said[0].filename == __file__


INERT = ["csv", "tensorboard", "profile", "lr_find", "mlflow", "wandb", "ema", "early_stopping", "smoke"]
"""The built-in plugins inert when merely discovered (outside a smoke run)."""


@pytest.mark.fault
def test_plugins_inert_when_merely_discovered_get_no_event_even_after_a_failed_configure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The run leaves them out before configure: a plugin's configure that fails first (a
    resume file that does not exist) no longer leaves them registered for fit_end, where the
    trackers opened runs the user never asked for and profile said it recorded nothing."""
    import warnings

    monkeypatch.chdir(tmp_path)  # where MLflow's and W&B's defaults would write
    monkeypatch.setenv("HOOKFIT_PLUGINS", ",".join(["optim", "metrics", *INERT]))
    seen: dict[str, list[str]] = {}

    class Fails:
        name = "fails"

        @hookfit.hookimpl(tryfirst=True)
        def configure(self, loop):
            seen["configure"] = sorted(loop.pm.participants())
            raise FileNotFoundError("no/such/file.pt")

        @hookfit.hookimpl
        def fit_end(self, loop):
            seen["fit_end"] = sorted(loop.pm.participants())

    with warnings.catch_warnings(record=True) as caught, pytest.raises(FileNotFoundError):
        warnings.simplefilter("always")
        run(plugins=[Fails()], run_dir=tmp_path / "run")
    assert seen["configure"] == seen["fit_end"] == ["fails", "metrics", "optim"]
    assert [str(w.message) for w in caught] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no store, no W&B folder, no run folder
    assert "profile" not in capsys.readouterr().out


@pytest.mark.parametrize("own_name", ["", "name = 'other'"])
def test_a_discovered_plugin_is_left_out_as_inert_by_its_entry_point_s_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_name: str) -> None:
    """A discovered plugin is named by its entry point: one with no ``name`` attribute, or another
    name, that is inert merely discovered is left out of the run, as ``hookfit plugins`` lists it."""
    site = make_dist(tmp_path / "site", "quiet-demo", {"quietdemo": "quiet_demo_mod:Quiet"}, {"quiet_demo_mod": f"""
        import hookfit

        SEEN = []

        class Quiet:
            {own_name}

            def inert(self, chosen):
                return None if chosen else "given to Loop"

            @hookfit.hookimpl
            def fit_start(self, loop):
                SEEN.append("fit_start")
        """})
    sys.path.insert(0, str(site))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "quietdemo")
    hookfit.discovery.refresh()
    try:
        from quiet_demo_mod import SEEN, Quiet

        loop = run()
        assert SEEN == [] and "quietdemo" not in loop.run.pm.participants()
        run(plugins=[Quiet()])  # chosen: it takes part
        assert SEEN == ["fit_start"]
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("quiet_demo_mod", None)
        hookfit.discovery.refresh()


def test_a_plugin_inert_merely_discovered_takes_part_when_the_run_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """smoke answers inert(chosen, loop) for the run that asks: a smoke run keeps it (it makes
    the run one), any other leaves it out before configure."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "optim,metrics,smoke")
    seen = []

    class Look:
        name = "look"

        @hookfit.hookimpl
        def fit_start(self, loop):
            seen.append(loop.pm.participants())

    run(plugins=[Look()])
    run(plugins=[Look()], smoke=True)
    assert seen == [["metrics", "optim", "look"], ["metrics", "optim", "smoke", "look"]]
