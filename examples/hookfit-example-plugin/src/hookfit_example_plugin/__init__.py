"""hookfit-example-plugin: a minimal, complete third-party hookfit plugin.

:class:`ExampleCounter` counts the batches of every stage (``"train"``, ``"valid"``) and, when the
run ends, writes a one-line JSON summary to the file named by the environment variable
``HOOKFIT_EXAMPLE_OUT``. Without that variable it only counts (the counts stay readable on the
instance, e.g. when the plugin is given to ``Loop(plugins=[...])`` directly).

It is registered in this distribution's ``pyproject.toml`` under the ``hookfit`` entry-point
group as ``example_counter``; installing the distribution is enough for every ``hookfit.Loop``
to use it, and ``HOOKFIT_DISABLE_PLUGINS=example_counter`` switches it off.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from hookfit import hookimpl

__all__ = ["ExampleCounter", "ENV_OUT"]
__version__ = "0.1.0"

ENV_OUT = "HOOKFIT_EXAMPLE_OUT"
"""Environment variable naming the file the summary is written to at ``fit_end``."""


class ExampleCounter:
    """Counts batches per stage and writes a JSON summary when the run ends.

    Summary (one line of JSON, the file is overwritten)::

        {"batches": {"train": 10, "valid": 4}, "epochs": 2, "plugin": "example_counter",
         "skipped": {"train": 0, "valid": 0}, "stages": {"train": 2, "valid": 2},
         "status": "completed", "steps": 10, "stop_reason": "max_epochs=2 reached"}

    ``batches`` counts every batch that finished (skipped ones included), ``skipped`` those whose
    step returned ``None``, ``stages`` how often each stage started; ``status`` and
    ``stop_reason`` are ``loop.state``'s final values, ``steps`` is ``loop.state.step`` and
    ``epochs`` the number of epochs that began.

    The counts are reset at ``fit_start``, so one instance given to several loops reports each
    run on its own. If the file cannot be written, ``fit_end`` raises, and hookfit reports the
    run as failed (or warns, if it had failed already): a summary asked for is never dropped
    silently.
    """

    name = "example_counter"

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.batches: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        self.stages: dict[str, int] = {}
        self.epochs = 0
        self.summary: dict[str, Any] | None = None

    @hookimpl
    def fit_start(self) -> None:
        self._reset()  # a fresh count for every run

    @hookimpl
    def epoch_start(self) -> None:
        self.epochs += 1

    @hookimpl
    def stage_start(self, stage: str) -> None:
        self.stages[stage] = self.stages.get(stage, 0) + 1
        self.batches.setdefault(stage, 0)
        self.skipped.setdefault(stage, 0)

    @hookimpl
    def batch_end(self, loop: Any, output: Mapping[str, Any] | None) -> None:
        # Per-batch hot path: two dict updates, nothing kept from the batch or the output. The
        # stage is the loop's (a validation may run inside the training stage: stages nest).
        stage = loop.state.stage or "unknown"
        self.batches[stage] = self.batches.get(stage, 0) + 1
        if output is None:
            self.skipped[stage] = self.skipped.get(stage, 0) + 1

    @hookimpl
    def fit_end(self, loop: Any) -> None:
        state = loop.state
        self.summary = {
            "plugin": self.name,
            "status": state.status,
            "stop_reason": state.stop_reason,
            "epochs": self.epochs,
            "steps": state.step,
            "batches": dict(self.batches),
            "skipped": dict(self.skipped),
            "stages": dict(self.stages),
        }
        out = os.environ.get(ENV_OUT)
        if not out:
            return
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.summary, sort_keys=True) + "\n", encoding="utf-8")
