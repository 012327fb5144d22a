"""Discovery, selection, validation and per-batch dispatch of plugins.

Distributions are made for real: a ``*.dist-info`` folder with ``METADATA`` and
``entry_points.txt`` on ``sys.path`` is exactly what ``importlib.metadata`` discovers for an
installed package (the pip-installed example package has its own end-to-end test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hookfit
from hookfit import manager
from hookfit.dispatch import Dispatch


def make_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[hookfit]\n{lines}\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return root


PLUGINS = '''
import hookfit

CALLS = []

class Alpha:
    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        CALLS.append(("alpha", batch_idx))

@hookfit.hookimpl
def batch_end(batch_idx):
    CALLS.append(("beta", batch_idx))
'''


BUILTINS = ",".join(ep.name for ep in manager.entry_points() if ep.dist.name == "hookfit")


@pytest.fixture
def dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two plugins of one distribution, one a class and one a module."""
    root = make_dist(
        tmp_path / "site", "fake-plugins",
        {"beta": "fake_plugins_mod", "alpha": "fake_plugins_mod:Alpha"},
        {"fake_plugins_mod": PLUGINS},
    )
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("HOOKFIT_PLUGINS")
    monkeypatch.setenv("HOOKFIT_DISABLE_PLUGINS", BUILTINS)
    sys.modules.pop("fake_plugins_mod", None)
    yield root
    sys.modules.pop("fake_plugins_mod", None)


def calls() -> list:
    return sys.modules["fake_plugins_mod"].CALLS


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


def test_unknown_name_in_disable_warns_with_suggestion(dists: Path) -> None:
    with pytest.warns(hookfit.HookfitWarning, match=r"'alfa' \(disabled\).*did you mean 'alpha'"):
        run(disable=["alfa"])


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
    assert steps == [] and loop.state.status == "idle"


def test_wrong_argument_name_fails_naming_plugin_and_hook() -> None:
    class Wrong:
        name = "wrong"

        @hookfit.hookimpl
        def batch_end(self, loop, outptu):
            pass

    with pytest.raises(hookfit.PluginError, match=r"plugin 'wrong'.*batch_end.*outptu"):
        hookfit.Loop(lambda loop, b: None, [1], plugins=[Wrong()]).fit()


def test_optional_hook_for_an_absent_event_is_allowed() -> None:
    class Consumer:
        @hookfit.hookimpl(optionalhook=True)
        def some_other_plugins_event(self):
            pass

    assert hookfit.Loop(lambda loop, b: None, [1], plugins=[Consumer()]).fit().status == "completed"


def test_two_given_plugins_with_one_name() -> None:
    class P:
        name = "same"

    with pytest.raises(hookfit.PluginError, match="both named 'same'"):
        hookfit.Loop(lambda loop, b: None, [1], plugins=[P(), P()]).fit()


# -- dispatch: the direct path keeps pluggy's semantics -------------------------------------

def ordered_plugins(log: list) -> list:
    def plugin(label: str, **opts):
        class P:
            name = label

            @hookfit.hookimpl(**opts)
            def batch_end(self, output, loop):  # argument order differs from the spec
                log.append((label, output))

        return P()

    return [plugin("last", trylast=True), plugin("a"), plugin("first", tryfirst=True), plugin("b")]


def test_direct_dispatch_order_equals_pluggys() -> None:
    log: list = []
    loop = hookfit.Loop(lambda loop, b: {"b": b}, [7], plugins=ordered_plugins(log))
    loop.fit()
    direct = [label for label, _ in log]
    log.clear()
    loop.run.pm.hook.batch_end(loop=loop, output={"b": 7}, batch=7, batch_idx=0)
    assert direct == [label for label, _ in log] == ["first", "b", "a", "last"]


def test_wrappers_go_through_pluggy() -> None:
    log: list = []

    class Wrapper:
        @hookfit.hookimpl(wrapper=True)
        def batch_end(self, batch_idx):
            log.append(("before", batch_idx))
            result = yield
            log.append(("after", batch_idx))
            return result

    loop = hookfit.Loop(lambda loop, b: None, [0], plugins=ordered_plugins(log) + [Wrapper()])
    loop.fit()
    assert log[0] == ("before", 0) and log[-1] == ("after", 0) and len(log) == 6


def test_tracing_switches_to_pluggys_call_path_and_back() -> None:
    traced: list = []
    log: list = []

    class Tracer:
        @hookfit.hookimpl
        def epoch_start(self, loop):
            self.undo = loop.pm.add_hookcall_monitoring(
                lambda name, impls, kwargs: traced.append(name), lambda *a: None
            )

        @hookfit.hookimpl
        def epoch_end(self, loop):
            self.undo()

    tracer = Tracer()
    loop = hookfit.Loop(lambda loop, b: None, [0, 1], plugins=ordered_plugins(log) + [tracer])
    loop.fit()
    assert traced.count("batch_end") == 2 and traced.count("batch_start") == 0
    assert loop.run.pm.monitors == 0


def test_plugin_registered_mid_run_is_called_from_then_on() -> None:
    late: list = []

    class Late:
        @hookfit.hookimpl
        def batch_end(self, batch_idx):
            late.append(batch_idx)

    class Registrar:
        @hookfit.hookimpl
        def batch_start(self, loop, batch_idx):
            if batch_idx == 2:
                loop.pm.register(Late(), name="late")

    hookfit.Loop(lambda loop, b: None, range(5), plugins=[Registrar()]).fit()
    assert late == [2, 3, 4]


def test_events_without_implementations_resolve_to_nothing() -> None:
    loop = hookfit.Loop(lambda loop, b: None, [1])
    loop.fit()
    dispatch = Dispatch(loop.run.pm)
    assert (dispatch.batch_start, dispatch.step_output, dispatch.batch_end, dispatch.should_stop) == (None,) * 4
    assert dispatch.call_each("should_stop", loop.run) == []


# -- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_epochs": 0}, ValueError, "max_epochs must be a positive integer, got 0"),
        ({"max_epochs": -2}, ValueError, "max_epochs must be a positive integer, got -2"),
        ({"max_steps": 0}, ValueError, "max_steps must be a positive integer"),
        ({"val_step": lambda l, b: None}, ValueError, "val_step .* without val_data"),
        ({"val_data": [1]}, ValueError, "val_data was given without a val_step"),
        ({"val_grad_mode": "off"}, ValueError, "val_grad_mode"),
        ({"model": "resnet"}, TypeError, "model must be a torch.nn.Module"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hookfit.Loop(lambda l, b: None, [1], **kwargs)


def test_train_data_not_iterable() -> None:
    with pytest.raises(TypeError, match="train_data must be an iterable of batches.*got int"):
        hookfit.Loop(lambda l, b: None, 5)


def test_empty_data_fails_the_run_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_PLUGINS", "interrupter")
    before = signal.getsignal(signal.SIGINT)
    loop = hookfit.Loop(lambda l, b: None, [])
    with pytest.raises(ValueError, match="train data yielded no batches in epoch 0"):
        loop.fit()
    assert loop.state.status == "failed"
    assert signal.getsignal(signal.SIGINT) is before  # the interrupter's fit_end ran


def test_exhausted_generator_is_explained() -> None:
    with pytest.raises(ValueError, match="epoch 1 .*iterator or generator is used up"):
        hookfit.Loop(lambda l, b: None, (i for i in range(3)), max_epochs=2).fit()


# -- the command line ---------------------------------------------------------------------

def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hookfit.cli", *args], capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=120,
    )


def test_hookfit_plugins_lists_name_distribution_hooks_and_state(dists: Path, tmp_path: Path) -> None:
    make_dist(tmp_path / "broken", "broken-plugin", {"broken": "does_not_exist_mod"}, {})
    path = os.pathsep.join([str(dists), str(tmp_path / "broken")])
    env = {"PYTHONPATH": path, "HOOKFIT_DISABLE_PLUGINS": "beta"}  # built-ins listed too
    env.pop("HOOKFIT_PLUGINS", None)
    result = cli("plugins", "--json", env={**env})
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["alpha"]["distribution"] == "fake-plugins" and rows["alpha"]["version"] == "1.2.3"
    assert rows["alpha"]["enabled"] is True and rows["alpha"]["hooks"] == ["batch_end"]
    assert rows["beta"]["enabled"] is False
    assert "ModuleNotFoundError" in rows["broken"]["error"]
    assert rows["interrupter"]["distribution"] == "hookfit"
    assert result.returncode == 1  # a broken plugin is an error, listed not hidden

    text = cli("plugins", env={**env, "HOOKFIT_DISABLE_PLUGINS": "broken"})
    assert text.returncode == 0, text.stderr
    assert "alpha  [enabled]  fake-plugins 1.2.3" in text.stdout
    assert "hooks: batch_end" in text.stdout
    assert "broken  [disabled]" in text.stdout


def test_hookfit_hooks_prints_every_event() -> None:
    from conftest import spec_names

    out = cli("hooks").stdout
    for name in spec_names():
        assert f"\n{name}(" in "\n" + out


def test_loop_hooks_resolve_any_event_once_and_again_after_changes() -> None:
    seen = []

    class Listener:
        @hookfit.hookimpl
        def before_backward(self, loss):
            seen.append(loss)
            return "heard"

    class Probe:
        @hookfit.hookimpl
        def fit_start(self, loop):
            assert loop.hooks.before_backward is None  # nothing implements it: costs nothing
            with pytest.raises(AttributeError, match="no hookfit event named 'before_backwards'"):
                loop.hooks.before_backwards
            loop.pm.register(Listener(), name="listener")
            assert loop.hooks.before_backward(loop, 1.5) == ["heard"]  # pluggy's result semantics

    hookfit.Loop(lambda loop, b: None, [1], plugins=[Probe()]).fit()
    assert seen == [1.5]


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


def test_a_misspelt_declared_event_is_still_caught() -> None:
    class Typo:
        name = "typo"

        @hookfit.hookimpl
        def samples_generatd(self, images):
            pass

    with pytest.raises(hookfit.PluginError, match="Did you mean 'samples_generated'"):
        hookfit.Loop(lambda l, b: None, [1], plugins=[Sampler(), Typo()]).fit()


def test_hookfit_run_fixture_trains_with_exactly_the_given_plugins(hookfit_run, hookfit_recorder) -> None:
    from hookfit.plugins.optim import Optim

    loop = hookfit_run(Optim(), hookfit_recorder)
    assert loop.state.status == "completed"
    assert [n for n, _ in loop.run.pm.list_name_plugin()] == ["optim", "recorder"]
    assert hookfit_recorder.names().count("after_optimizer_step") == 4


def test_the_hooks_reference_page_is_up_to_date() -> None:
    from pathlib import Path

    from hookfit.cli import hooks_reference

    page = Path(__file__).resolve().parents[1] / "core" / "hooks.md"
    assert page.read_text() == hooks_reference(markdown=True), (
        "core/hooks.md is stale: run `hookfit hooks --markdown > core/hooks.md`")
