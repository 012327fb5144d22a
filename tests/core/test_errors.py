"""hookfit.errors: the warning category, and where hookfit's warnings point: at the script's
line that ran ``fit()`` (:func:`hookfit.errors.user_level`), not at the plugin or the event
call they came through."""

from __future__ import annotations

import warnings

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
