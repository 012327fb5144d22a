"""profile: ``torch.profiler`` over a few training steps, a trace to open, the slowest operators.

``Profile(wait=1, warmup=1, active=3, repeat=1)`` in ``Loop(plugins=[...])``, or a
``[plugins.profile]`` table in ``hookfit.toml``. Discovered like every plugin, it is inert until
configured that way: the run leaves the instance discovered without options out before
``configure`` (:func:`hookfit.manager.leave_inert`), so no hook of it runs, not even after a
start-up that failed, and a run pays nothing for it.

* **Schedule.** It drives :class:`torch.profiler.profile` with
  ``torch.profiler.schedule(skip_first=..., wait=..., warmup=..., active=..., repeat=...)``,
  started right before the first training batch and stepped once per training batch (the
  ``batch_end`` of the ``"train"`` stage): the profiler's step ``N`` (``ProfilerStep#N`` in the
  trace and the table) is this ``fit()``'s training batch ``N``, counting from 0, and its span
  runs from the end of the batch before to the end of that batch (so it holds the data loading
  of its batch too). Each cycle skips ``wait`` steps, warms up for ``warmup`` and records
  ``active``; ``repeat`` cycles in all (``0``: until the run ends). Validation batches do not
  step the schedule, nested in the training stage (``Loop(val_every_n_steps=N)``) or after it:
  a validation that runs while the profiler records is recorded within the step it runs in,
  as the time it takes from training. ``Loop.validate()`` has no training batch: there the
  validation batches step the schedule. CPU activity is recorded, and CUDA's when CUDA is
  available; ``record_shapes``, ``profile_memory`` and ``with_stack`` are passed to the
  profiler as they are.
* **Trace.** Each recorded cycle is written to the run folder (:attr:`hookfit.run.Run.run_dir`),
  as ``profile/<host>_<pid>.<time in ns>.pt.trace.json``, the names
  ``torch.profiler.tensorboard_trace_handler`` gives, so TensorBoard's profiler plugin opens the
  run folder (``tensorboard --logdir <run folder>``, with ``torch-tb-profiler`` installed)
  and Perfetto (https://ui.perfetto.dev) or Chrome's ``chrome://tracing`` open each file. The
  trace is exported to a temporary file first and then copied in, because the profiler's own
  export reports no error when it cannot write (a full disk leaves a torn file behind without
  a word); so a file that cannot be written (a read-only run folder, a full disk) gives one
  :class:`hookfit.files.FileWarning` naming it and the error, leaves no partial file, and
  training goes on (later cycles are not written; their operators are still counted).
  Main process only: under ``torchrun`` the other processes do not profile.
* **End.** At ``fit_end`` (``tryfirst``, so that other plugins' end-of-run work is not
  recorded), whatever the status (completed, interrupted or failed), the profiler is stopped;
  a cycle cut short by the end of the run is still written, with the steps it recorded. Then it
  prints, on standard output (``stream`` if given) as the console prints its summary, one line
  per trace written: ``hookfit profile steps=<a>-<b> profiler_steps=<n>-<m> trace=<file>`` (the
  run's own step numbers, counted as the console counts them, then the ``ProfilerStep``
  numbers in the trace), a line saying how to open them, and the table of the slowest
  operators of every recorded step (``key_averages().table(sort_by=..., row_limit=...)``, added
  up over the cycles). A run that ended before the first active step says so instead
  (``hookfit profile nothing_recorded reason="..."``).
* It is an observer (``observer = True``): it takes part in the run's time, never in its results,
  so if it fails it is switched off for the rest of the run with one warning, and the profiler
  is stopped first.

Options are checked at construction, with a ``ValueError`` naming the option.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Concatenate, ParamSpec, TextIO, TypeVar

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.errors import user_level
from hookfit.files import FileWarning
from hookfit.plugins.profile.report import Cycle, Report, Table, field, span
from hookfit.plugins.profile.traces import export
from hookfit.plugins.support import check, flag, integer, option_error

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from torch.profiler import profile as Profiler

    from hookfit.run import Run

__all__ = ["Profile", "SORT_KEYS", "FOLDER"]

FOLDER = "profile"
"""The folder of the run folder the traces are written to."""

SORT_KEYS = (
    "self_cpu_time_total", "cpu_time_total", "cpu_time",
    "self_device_time_total", "device_time_total", "device_time",
    "self_cuda_time_total", "cuda_time_total", "cuda_time",
    "self_cpu_memory_usage", "cpu_memory_usage",
    "self_device_memory_usage", "device_memory_usage",
    "self_cuda_memory_usage", "cuda_memory_usage",
    "count", "flops",
)
"""What ``Profile(sort_by=...)`` may sort the table by (the columns ``torch.profiler`` knows)."""

P = ParamSpec("P")
R = TypeVar("R")


def _guarded(method: Callable[Concatenate[Profile, P], R]) -> Callable[Concatenate[Profile, P], R]:
    """A failure of the plugin stops the profiler before the dispatcher switches the plugin off
    (it then receives no ``fit_end``, and the profiler must not go on recording)."""

    @functools.wraps(method)
    def guarded(self: Profile, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except Exception:
            self._abandon()
            raise

    return guarded


@records_options
class Profile:
    """``torch.profiler`` on a schedule of training steps: a trace per recorded cycle in the run
    folder and a table of the slowest operators at the end (see the module documentation).

    ``wait``, ``warmup``, ``active``, ``repeat`` and ``skip_first`` are
    :func:`torch.profiler.schedule`'s, counted in training batches; ``record_shapes``,
    ``profile_memory`` and ``with_stack`` go to :class:`torch.profiler.profile`; ``sort_by``
    (one of :data:`SORT_KEYS`; by default the operators' own time on the device when CUDA is
    recorded, else on the CPU) and ``row_limit`` shape the table; ``stream`` is where the end
    of the run is printed (standard output by default)."""

    name = "profile"
    observer = True  # it watches the run: a failure switches it off, never the run

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, repeat: int = 1, skip_first: int = 0,
                 record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
                 sort_by: str | None = None, row_limit: int = 10, stream: TextIO | None = None) -> None:
        name = self.name
        self.wait = integer(name, "wait", wait, least=0, meaning="training steps skipped at the start of each cycle")
        self.warmup = integer(name, "warmup", warmup, least=0,
                              meaning="training steps the profiler warms up for in each cycle")
        self.active = integer(name, "active", active, least=1, meaning="training steps recorded in each cycle")
        self.repeat = integer(name, "repeat", repeat, least=0, meaning="cycles; 0 repeats them until the run ends")
        self.skip_first = integer(name, "skip_first", skip_first, least=0,
                                  meaning="training steps skipped before the first cycle")
        self.record_shapes = flag(self.name, "record_shapes", record_shapes)
        self.profile_memory = flag(self.name, "profile_memory", profile_memory)
        self.with_stack = flag(self.name, "with_stack", with_stack)
        check(self.name, "sort_by", sort_by, lambda key: key is None or key in SORT_KEYS,
              f"be one of {', '.join(SORT_KEYS)} (or None for the operators' own time)")
        self.sort_by = sort_by
        self.row_limit = integer(name, "row_limit", row_limit, least=1,
                                 meaning="rows of the table of the slowest operators")
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise option_error(self.name, "stream", stream, "be a text stream (with write()), or None for standard "
                               "output", shown=type(stream).__name__)
        self.stream = stream
        self.traces: list[Path] = []
        """The trace files written by the current or last run."""
        self._prof: Profiler | None = None  # the torch.profiler.profile while it runs
        self._plan: Callable[[int], object] = lambda step: None  # its schedule
        self._report = Report()
        self._recorded: list[tuple[int, int]] = []  # the current cycle's recorded steps so far
        self._stepping_stage = "train"
        self._folder: Path | None = None
        self._failed = False  # a trace could not be written: later ones are not tried
        self._started = False
        self._steps = 0  # batches that stepped the schedule in this run

    # -- the schedule ---------------------------------------------------------------------
    @property
    def period(self) -> int:
        """Training steps in one cycle: ``wait + warmup + active``."""
        return self.wait + self.warmup + self.active

    @property
    def first_active(self) -> int:
        """The profiler step (this ``fit()``'s training batch, from 0) of the first recorded step."""
        return self.skip_first + self.wait + self.warmup

    def _finished(self, step: int) -> bool:
        """Whether every cycle is over once the profiler reached ``step``."""
        return self.repeat > 0 and step >= self.skip_first + self.repeat * self.period

    # -- events ---------------------------------------------------------------------------
    def inert(self, chosen: bool) -> str | None:
        """What ``hookfit plugins`` says of it (:func:`hookfit.discovery.inert`): inert until
        chosen: merely discovered, it leaves the run before ``configure``."""
        if chosen:
            return None
        return ("given to Loop(plugins=[Profile(...)]), or named by a [plugins.profile] table in hookfit.toml "
                "(even empty)")

    @hookimpl
    def configure(self, loop: Run) -> None:
        self._reset()
        if not loop.is_main:  # (an inert one is not in the run: hookfit.manager.leave_inert)
            loop.pm.unregister(self)  # not the main process: no hook below costs anything

    def _reset(self) -> None:
        self._abandon()
        self._report = Report()
        self._recorded = []
        self._folder = None
        self._failed = False
        self._started = False
        self._steps = 0
        self.traces = []

    @hookimpl
    @_guarded
    def fit_start(self, loop: Run) -> None:
        self._stepping_stage = "train" if getattr(loop, "mode", "fit") == "fit" else "valid"

    @hookimpl
    @_guarded
    def stage_start(self, loop: Run, stage: str) -> None:
        if stage == self._stepping_stage and not self._started:
            self._started = True
            self._start(loop)

    @hookimpl
    @_guarded
    def batch_end(self, loop: Run) -> None:
        prof = self._prof
        if prof is None or loop.training != (self._stepping_stage == "train"):
            return
        from torch.profiler import ProfilerAction

        if prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self._recorded.append((loop.state.step if self._stepping_stage == "train" else self._steps + 1,
                                   prof.step_num))
        self._steps += 1
        if prof.current_action in (ProfilerAction.NONE, ProfilerAction.RECORD_AND_SAVE) \
                and self._plan(prof.step_num + 1) != ProfilerAction.NONE:  # a new cycle begins
            with warnings.catch_warnings():
                # torch's advice for key_averages() over several cycles: this plugin adds them up itself
                warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
                prof.step()
        else:
            prof.step()  # a cycle that ends here is written now (_ready)
        if self._finished(prof.step_num):
            self._prof = None
            prof.stop()  # every cycle is over: nothing more to record, nothing more to pay

    @hookimpl(tryfirst=True)  # before other plugins' end-of-run work, which is no training step
    def fit_end(self, loop: Run) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()  # a cycle the run cut short is written now (_ready)
            except Exception:
                self._abandon(prof)
                raise
        self._print_report(loop)

    # -- profiling ------------------------------------------------------------------------
    def _start(self, loop: Run) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            # warmup=0 is the user's choice, made knowingly: torch's advice is not repeated each run
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup", category=UserWarning)
            plan = schedule(skip_first=self.skip_first, wait=self.wait, warmup=self.warmup, active=self.active,
                            repeat=self.repeat)
        self._plan = plan
        self._folder = (loop.run_dir / FOLDER).absolute()
        prof = profile(activities=activities, schedule=plan, on_trace_ready=self._ready,
                       record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                       with_stack=self.with_stack)
        prof.start()
        self._prof = prof

    def _abandon(self, prof: Profiler | None = None) -> None:
        """Stop the profiler without writing anything (the plugin failed)."""
        prof = prof if prof is not None else self._prof
        self._prof = None
        if prof is None:
            return
        prof.on_trace_ready = None
        with contextlib.suppress(Exception):
            prof.stop()

    def _ready(self, prof: Profiler) -> None:
        """A cycle is over (or cut short by the end of the run): count its operators and write
        its trace."""
        steps, self._recorded = self._recorded, []
        if not steps:  # the run ended right after the warm-up: the trace would hold only its end
            return
        cycle = Cycle(steps=steps, active=self.active, cut=self._prof is None and len(steps) < self.active)
        report = self._report
        for average in prof.key_averages():
            mine = report.averages.get(average.key)
            if mine is None:
                from torch.autograd.profiler_util import FunctionEventAvg

                mine = report.averages[average.key] = FunctionEventAvg()
            mine.add(average)
            report.use_device = report.use_device or average.use_device
        report.cycles.append(cycle)
        if self._folder is None:
            return
        if self._failed:
            cycle.error = "not tried after an earlier trace could not be written"
            return
        path = self._folder / f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"
        error = export(prof, path)
        if error is None:
            cycle.trace = path
            self.traces.append(path)
            return
        self._failed = True
        cycle.error = f"{type(error).__name__}: {error}"
        warnings.warn(f"profile: could not write {path} ({cycle.error}); training goes on without this trace",
                      FileWarning, stacklevel=user_level())

    # -- the end --------------------------------------------------------------------------
    def _print(self, *fields: str) -> None:
        print("hookfit profile " + " ".join(f for f in fields if f), file=self.stream or sys.stdout, flush=True)

    def _print_report(self, loop: Run) -> None:
        report = self._report
        recorded = report.cycles  # every one with a step at least (see _ready)
        if not recorded:
            self._print("nothing_recorded", field("reason", self._nothing(loop)))
            return
        for cycle in recorded:
            (first, first_n), (last, last_n) = cycle.steps[0], cycle.steps[-1]
            fields = [f"steps={span(first, last)}", f"profiler_steps={span(first_n, last_n)}"]
            if cycle.cut:
                fields.append(field("cut_short", f"the run ended after {len(cycle.steps)} of the {cycle.active} "
                                                  f"active steps; ProfilerStep#{last_n + 1} holds the rest of the run"))
            if cycle.trace is not None:
                fields.append(field("trace", str(cycle.trace)))
            else:
                fields.append(field("trace_not_written", cycle.error or "no run folder"))
            self._print(*fields)
        if self.traces:
            run_folder = self.traces[0].parent.parent
            self._print(field("tensorboard", f"tensorboard --logdir {run_folder} (with torch-tb-profiler)"),
                        field("perfetto", "https://ui.perfetto.dev or chrome://tracing: open a .pt.trace.json"))
        table = self._table()
        count = sum(len(c.steps) for c in recorded)
        self._print("slowest", f"sort_by={self._sort_key()}", f"rows={min(self.row_limit, len(report.averages))}",
                    f"recorded_steps={count}")
        out = self.stream or sys.stdout
        print(table.rstrip("\n"), file=out, flush=True)

    def _nothing(self, loop: Run) -> str:
        unit = "training" if self._stepping_stage == "train" else "validation"
        if not self._started:
            return f"no {unit} batch ran"
        return (f"the run ended after {self._steps} {unit} step(s) of this fit(), before the first active step "
                f"of the schedule (its {unit} step {self.first_active + 1}: skip_first={self.skip_first}, "
                f"wait={self.wait}, warmup={self.warmup})")

    def _sort_key(self) -> str:
        if self.sort_by is not None:
            return self.sort_by
        return "self_device_time_total" if self._report.use_device else "self_cpu_time_total"

    def _table(self) -> str:
        from torch.autograd.profiler_util import EventList

        report = self._report
        events: Callable[..., Table] = EventList  # unannotated in torch: its table() gives a str
        return events(list(report.averages.values()), use_device=report.use_device,
                      profile_memory=self.profile_memory).table(sort_by=self._sort_key(), row_limit=self.row_limit)
