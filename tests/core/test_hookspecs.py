"""hookfit.hookspecs and the plugins' own hookspecs: every event is documented where it is
declared, and fired by the loop or a built-in plugin in the runs below; the core's vocabulary
stays the loop's."""

from __future__ import annotations

import pytest
import torch

import hookfit
import hookfit.tools.hookspecs
from conftest import Recorder, spec_names


class Boom(Exception):
    pass


def declared_in(module) -> dict[str, str]:
    """The events a spec module declares, read from its source, with their docstrings."""
    import ast
    from pathlib import Path

    declared = {}
    for node in ast.parse(Path(module.__file__).read_text()).body:
        if isinstance(node, ast.FunctionDef) and any(
            getattr(d, "id", None) == "hookspec" or getattr(getattr(d, "func", None), "id", None) == "hookspec"
            for d in node.decorator_list
        ):
            declared[node.name] = ast.get_docstring(node) or ""
    return declared


def builtin_events() -> dict[str, dict[str, str]]:
    """Each built-in plugin that declares events: {plugin: {event: docstring}}."""
    from hookfit import discovery

    return {name: declared_in(specs) for name, specs in discovery.discovered_events()
            if specs.__name__.startswith("hookfit.plugins.")}


def test_the_core_vocabulary_is_the_loops_and_the_plugins_declare_theirs() -> None:
    """At most 22 events in hookfit.hookspecs, the loop's own; the command line's
    (``add_commands``) is hookfit.tools.hookspecs'; the optimizer, metrics, checkpoint,
    distributed and terminal events are declared by the plugins that fire or answer them."""
    core = spec_names()
    assert len(core) <= 22, sorted(core)
    assert "add_commands" not in core and set(declared_in(hookfit.tools.hookspecs)) == {"add_commands"}
    plugins = builtin_events()
    assert {event: name for name, events in plugins.items() for event in events} == {
        "before_backward": "optim", "after_backward": "optim", "before_optimizer_step": "optim",
        "after_optimizer_step": "optim", "step_skipped": "optim", "should_sync_gradients": "optim",
        "metrics_update": "metrics", "epoch_metrics": "metrics", "metrics_values": "metrics",
        "checkpoint_saved": "checkpoint", "all_reduce": "distributed", "claim_output": "tui",
    }
    assert not set(core) & {event for events in plugins.values() for event in events}


def test_every_hookspec_is_documented_and_fired(tmp_path) -> None:
    """A new event cannot land undocumented, or without the loop or a built-in plugin firing it
    somewhere that these runs cover (normal run with validation, a stop request, a failure)."""
    declared = declared_in(hookfit.hookspecs)
    assert set(declared) == set(spec_names())
    declared.update(declared_in(hookfit.tools.hookspecs))
    for events in builtin_events().values():
        declared.update(events)
    for name, doc in declared.items():
        assert len(doc.split()) >= 15, f"hook {name!r} needs a docstring saying when it fires"

    fired: set[str] = set()
    rec = Recorder(results=True)
    hookfit.Loop(lambda l, b: {"x": 1}, [1], val_step=lambda l, b: None, val_data=[1], plugins=[rec]).fit()
    fired |= set(rec.names())
    assert rec.names()[-2:] == ["fit_end", "results"]

    rec = Recorder()

    class Stopper:
        @hookfit.hookimpl
        def batch_end(self, loop):
            loop.request_stop("test")

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hookfit.HookfitWarning)
        hookfit.Loop(lambda l, b: None, [1], plugins=[rec, Stopper()]).fit()
    fired |= set(rec.names())

    rec = Recorder()
    with pytest.raises(Boom):
        hookfit.Loop(lambda l, b: (_ for _ in ()).throw(Boom()), [1], plugins=[rec]).fit()
    fired |= set(rec.names())

    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.optim import Optim

    rec = Recorder(agree=True)
    model = torch.nn.Linear(1, 1)

    def optim_step(loop, x):
        loop.backward((model if loop.model is None else loop.model)(x).sum())  # the run's model, when it has one
        loop.optimizers.step()

    class TwoProcessesResumed:
        name = "two"

        @hookfit.hookimpl
        def configure(self, loop):
            loop.state.world_size = 2  # so that metrics asks for its sums to be reduced

        @hookfit.hookimpl
        def batch_start(self, loop):
            if (ask := loop.hooks.should_sync_gradients) is not None:  # as a distributed plugin does
                ask(loop)

        @hookfit.hookimpl
        def resume(self, loop):
            states = loop.plugin_states()
            states["recorder"] = {"anything": 1}
            loop.load_plugin_states(states, strict=False)
            loop.load_state_dict(loop.state_dict())  # the run's own position: where it is
            return True

    hookfit.Loop(optim_step, [torch.ones(1)], optimizers=torch.optim.SGD(model.parameters()), resume="x",
                 plugins=[Optim(), Metrics(sync_every=1), Console(), TwoProcessesResumed(), rec]).fit()
    fired |= set(rec.names())

    from hookfit.plugins.checkpoint import Checkpoint

    rec = Recorder()
    saved = torch.nn.Linear(1, 1)
    hookfit.Loop(optim_step, [torch.ones(1)], model=saved, optimizers=torch.optim.SGD(saved.parameters()),
                 run_dir=tmp_path, plugins=[Optim(), Checkpoint(), rec]).fit()
    fired |= set(rec.names())

    rec = Recorder()  # a step skipped for a non-finite loss is announced

    def nan_step(loop, x):
        loop.backward(saved(x).sum() * float("nan"))
        loop.optimizers.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hookfit.HookfitWarning)
        hookfit.Loop(nan_step, [torch.ones(1)], model=saved, optimizers=torch.optim.SGD(saved.parameters()),
                     plugins=[Optim(), rec]).fit()
    fired |= set(rec.names())

    class Command:  # the hookfit command asks plugins for theirs (hookfit export is one)
        @hookfit.hookimpl
        def add_commands(self, commands):
            fired.add("add_commands")
            commands.add_parser("recorded").set_defaults(run=lambda args: 7)

    from hookfit.tools import cli

    assert cli.main(["recorded"], plugins=[Command()]) == 7
    assert fired == set(declared), f"never fired: {set(declared) - fired}"
