"""hookfit.errors: the warning category, and where hookfit's warnings point: at the script's
line that ran ``fit()`` (:func:`hookfit.errors.user_level`), not at the plugin or the event
call they came through. hookfit's errors pickle as they are (another process, a copy of a run's error)."""

from __future__ import annotations

import pickle
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.early_stopping import EarlyStopping


@pytest.mark.parametrize("plugins, disable, says", [
    ([Checkpoint()], [], "checkpoints are off for this run: it has no model"),
    ([EarlyStopping()], [], "early_stopping: chosen for this run but without a monitor"),
    ([], ["consol"], "plugin name 'consol' (disabled) matches no installed or given plugin"),
])
def test_a_warning_at_the_runs_start_points_at_the_scripts_fit_line(plugins, disable, says) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(lambda loop, batch: None, [1], plugins=plugins, disable=disable).fit(); line = _line()
    [warning] = [w for w in caught if says in str(w.message)]
    assert issubclass(warning.category, hookfit.HookfitWarning)
    assert (warning.filename, warning.lineno) == (__file__, line), (warning.filename, warning.lineno)


def _line() -> int:
    """The line of the caller (the fit() above, written on the same line)."""
    import sys

    return sys._getframe(1).f_lineno


def test_a_warning_during_the_run_points_at_the_scripts_fit_line_too() -> None:
    """An observer switched off in a per-batch hook, and a checkpoint monitor naming a metric the
    run does not produce (said at the first epoch's metrics): both at the script's ``fit()``."""
    from hookfit.plugins.metrics import Metrics

    class Fragile:
        name = "fragile"
        observer = True

        @hookfit.hookimpl
        def batch_end(self, loop):
            raise RuntimeError("the observer's own error")

    data = [(torch.zeros(1, 1), torch.zeros(1, 1))]

    def step(loop, batch):
        return {"loss": torch.tensor(1.0)}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = hookfit.Loop(step, data, val_step=step, val_data=data, model=torch.nn.Linear(1, 1),
                            plugins=[Fragile(), Metrics(), Checkpoint(monitor="valid/los", background=False)])
        loop.fit(); line = _line()
    for says in ("observer plugin 'fragile'", "monitor='valid/los' names a metric this run does not produce"):
        [warning] = [w for w in caught if says in str(w.message)]
        assert (warning.filename, warning.lineno) == (__file__, line), (says, warning.filename, warning.lineno)


def test_each_run_of_a_sweep_shows_hookfit_s_warnings_and_the_user_s_filters_still_apply(tmp_path) -> None:
    """Three ``fit()`` from one line of a script's loop: Python's default action shows a warning
    once per text and line, and hookfit's point at that ``fit()`` line (a checkpoint monitor
    naming no metric) or at the step function's line (a backward pass outside
    ``loop.backward``), the same in every run; each run shows them again. The script's own
    warning shows once, as Python shows it; a filter the user set on hookfit's category
    (``ignore``, ``once``, ``error``) applies as it says."""
    from hookfit.plugins.checkpoint import CheckpointWarning
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.optim import Optim, OptimWarning

    def step(loop, batch):
        loss = loop.model(batch).square().mean()
        loss.backward(); backward_line = _line()  # outside loop.backward: optim warns at this line
        warnings.warn("the script's own warning"); own_line = _line()
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        lines.update(backward=backward_line, own=own_line)
        return {"loss": loss.detach()}

    def val_step(loop, batch):
        return {"loss": loop.model(batch).square().mean()}

    lines: dict[str, int] = {}

    def sweep(action: str | None) -> list[tuple[type[Warning], int]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            if action is not None:
                warnings.simplefilter(action, CheckpointWarning)
            for i in range(3):
                model = torch.nn.Linear(2, 1)
                loop = hookfit.Loop(step, [torch.ones(4, 2)], val_step=val_step, val_data=[torch.ones(4, 2)],
                                    model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                                    max_epochs=1, run_dir=tmp_path / f"{action}-{i}",
                                    plugins=[Optim(), Metrics(), Checkpoint(monitor="valid/acc", background=False)])
                loop.fit(); lines["fit"] = _line()
        return [(w.category, w.lineno) for w in caught if w.category in (CheckpointWarning, OptimWarning, UserWarning)]

    shown = sweep(None)
    assert shown.count((CheckpointWarning, lines["fit"])) == 3, shown
    assert shown.count((OptimWarning, lines["backward"])) == 3, shown
    assert shown.count((UserWarning, lines["own"])) == 1, shown  # not hookfit's: as Python shows it
    assert (CheckpointWarning, lines["fit"]) not in sweep("ignore")
    assert sweep("once").count((CheckpointWarning, lines["fit"])) == 1
    with pytest.raises(CheckpointWarning, match="monitor='valid/acc' names a metric"):
        sweep("error")


@pytest.mark.slow
def test_every_warning_category_hookfit_defines_derives_from_hookfit_warning() -> None:
    """What a user filters on (``-W error::hookfit.HookfitWarning``) and what each run shows
    again (:func:`hookfit.errors.forget_warnings`) is every category deriving from it."""
    import ast
    import importlib

    from conftest import REPO

    found = {}
    for folder, package in (("core", "hookfit"), ("plugins", "hookfit.plugins")):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = [node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name.endswith("Warning")]
            if names:
                parts = path.relative_to(REPO / folder).with_suffix("").parts
                module = importlib.import_module(".".join((package, *parts)).removesuffix(".__init__"))
                found.update({f"{module.__name__}.{name}": getattr(module, name) for name in names})
    assert len(found) >= 4, found  # ObserverWarning, FileWarning, OptimWarning, CheckpointWarning at least
    assert [name for name, kind in found.items() if not issubclass(kind, hookfit.HookfitWarning)] == []


def test_forgetting_the_shown_warnings_loads_no_lazily_imported_module_and_reads_every_kind(tmp_path: Path, monkeypatch) -> None:
    """A module imported with ``importlib.util.LazyLoader`` runs when first used, not when a run
    starts: reading it for shown warnings must not run it (its import may be slow, have effects
    of its own, or fail)."""
    import importlib.util

    (tmp_path / "lazy_hookfit_probe.py").write_text("import sys\nsys.modules[__name__].RAN = True\nvalue = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.find_spec("lazy_hookfit_probe")
    assert spec is not None and spec.loader is not None
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lazy_hookfit_probe", module)
    spec.loader.exec_module(module)
    # and a module of C whose dict object's own lookup does not find (a cffi library: cryptography's)
    cffi = pytest.importorskip("_cffi_backend")
    monkeypatch.setitem(sys.modules, "hookfit_probe_cffi_lib", cffi.FFI().dlopen(None))
    state = hookfit.Loop(lambda loop, batch: None, [1, 2], max_epochs=1, run_dir=tmp_path / "run").fit()
    assert state.status == "completed"
    assert type(module) is not types.ModuleType  # still the lazy module: not run
    assert module.value == 1 and module.RAN  # and it runs when used


@pytest.mark.parametrize("error", [
    hookfit.errors.RefusedAnswer("gauge", "metrics_values", "answered a list"),
    hookfit.errors.RefusedState("ema", "answered a lambda"),
    hookfit.errors.StateMismatch("one plugin differs", ["new"], ["gone"]),
], ids=["RefusedAnswer", "RefusedState", "StateMismatch"])
def test_hookfits_errors_with_arguments_of_their_own_pickle_with_them_and_their_notes(error: Exception) -> None:
    error.add_note("hookfit: raised by plugin 'gauge'")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.args == error.args
    assert copy.__notes__ == error.__notes__ and vars(copy) == vars(error)


HOW = (": hookfit has no logging call; a step function reports by returning its values, {'loss': loss, 'acc': acc} "
       "(README.md, 'A first script'), which the metrics plugin aggregates and every logger writes")


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["log", "log_dict"])
def test_lightning_s_logging_call_on_the_step_s_loop_says_how_hookfit_reports(name: str) -> None:
    """``loop.log("acc", acc)`` in a step (Lightning's ``self.log``): an ``AttributeError`` that says a step
    returns what it reports, naming the step function (its note); on the ``Loop`` too."""
    def train_step(loop, batch):
        getattr(loop, name)("acc", 1.0)

    with pytest.raises(AttributeError, match=rf"^'Run' object has no attribute {name!r}{re.escape(HOW)}\n"
                                             rf"hookfit: raised in step function '.*train_step'") as raised:
        hookfit.Loop(train_step, [1], disable=["checkpoint"]).fit()
    assert (raised.value.name, type(raised.value.obj).__name__) == (name, "Run")
    loop = hookfit.Loop(train_step, [1])
    with pytest.raises(AttributeError, match=rf"^'Loop' object has no attribute {name!r}{re.escape(HOW)}$"):
        getattr(loop, name)
    assert not hasattr(loop, name)


@pytest.mark.bad_input
@pytest.mark.parametrize("name, field", [("global_step", "step"), ("current_epoch", "epoch"), ("epoch", "epoch"),
                                         ("step", "step"), ("batch_idx", "batch_idx")])
def test_where_the_run_is_asked_of_the_wrong_object_names_the_state_field_that_holds_it(name: str, field: str) -> None:
    """``loop.global_step`` in a step (Lightning's ``self.global_step``), ``loop.epoch``: an ``AttributeError`` that
    names ``loop.state``'s field; ``state.global_step`` names the field of the state itself."""
    seen = []

    def train_step(loop, batch):
        seen.append(getattr(loop.state, field))
        getattr(loop, name)

    with pytest.raises(AttributeError, match=rf"^'Run' object has no attribute {name!r}: where the run is, is "
                                             rf"loop.state: loop.state.{field}\nhookfit: raised in step function"):
        hookfit.Loop(train_step, [1], disable=["checkpoint"]).fit()
    assert seen == [0]  # the field named is there
    state = hookfit.State()
    if not hasattr(state, name):
        with pytest.raises(AttributeError, match=rf"^'State' object has no attribute {name!r}: where the run is, "
                                                 rf"is state: state.{field}$"):
            getattr(state, name)
    assert getattr(state, "lgo", None) is None and not hasattr(state, "global_step")


def test_any_other_missing_attribute_is_python_s_own_error() -> None:
    loop = hookfit.Loop(lambda loop, batch: None, [1])
    with pytest.raises(AttributeError, match=r"^'Loop' object has no attribute 'lgo'$"):
        loop.lgo  # noqa: B018
    assert getattr(loop, "lgo", None) is None and getattr(loop.state, "log", None) is None


def _lightning_owners() -> dict[str, Callable[..., Any]]:
    from hookfit.plugins.optim import Optim

    loop = hookfit.Loop(lambda loop, batch: None, [1])
    return {"Loop": hookfit.Loop, "Loop.validate": loop.validate, "Optim": Optim, "Checkpoint": Checkpoint}


@pytest.mark.bad_input
@pytest.mark.parametrize("owner, name", [
    ("Optim", "accumulate_grad_batches"), ("Optim", "gradient_clip_val"), ("Optim", "lr_scheduler"),
    ("Checkpoint", "save_top_k"), ("Checkpoint", "dirpath"), ("Checkpoint", "every_n_train_steps"),
    ("Loop.validate", "ckpt_path"), ("Loop", "val_check_interval"), ("Loop", "check_val_every_n_epoch"),
    ("Loop", "default_root_dir")])
def test_lightning_s_keyword_names_hookfit_s_that_does_the_same(owner: str, name: str) -> None:
    """Spelling would not find them (``gradient_clip_val`` is closest to ``clip_value``, a different clip):
    each Lightning keyword names the one of hookfit's that does what it does, which the owner takes."""
    import inspect

    from hookfit.errors import LIGHTNING

    call = _lightning_owners()[owner]
    assert LIGHTNING[name] in inspect.signature(call).parameters
    with pytest.raises(TypeError, match=rf"^{re.escape(owner)}\(\) got an unexpected keyword argument {name!r}; did "
                                        rf"you mean {LIGHTNING[name]!r}\? \(what Lightning calls {name}\)$"):
        call(**{name: 1})
    assert set(LIGHTNING) == {"accumulate_grad_batches", "gradient_clip_val", "lr_scheduler", "save_top_k", "dirpath",
                              "every_n_train_steps", "ckpt_path", "val_check_interval", "check_val_every_n_epoch",
                              "default_root_dir"}  # every name is tried above
