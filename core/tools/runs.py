"""Run folders, read back: what ``hookfit runs`` lists and ``hookfit show`` / ``hookfit
compare`` draw.

A run folder (``runs/<name>/<date>-<time>``, or ``Loop(run_dir=...)``) holds ``run.jsonl``
(one ``"run"`` line per ``fit()`` written by the core as it starts, with the process's ``pid``
and ``host``, and an ``"end"`` line when it ends) and, with the metrics plugin, ``metrics.jsonl``
(rows of :meth:`hookfit.payloads.MetricsSnapshot.row` as ``"epoch"`` and ``"step"`` events, a
``"resume"`` line where a resumed run continues, an ``"end"`` line, and ``"best"`` lines with
the directions the user configured: ``{"event": "best", "metrics": {"valid/acc": "max"}}``).
Both are read tolerantly, past what is damaged: a line that is not a JSON object (a torn last
line of a run killed while writing, a line cut by a full disk) is skipped; in a line of
``metrics.jsonl`` (:func:`checked`), a value that is not what hookfit writes there is left out
(a metric ``"loss": "abc"`` or ``{}``, a ``time`` that is not a number), and a line whose place
cannot be read (its ``stage``, ``epoch`` or ``step``) is skipped. Reading changes nothing in the
folder, and never hangs: only regular files are read (a FIFO, a device, a folder in a file's
place are not opened for reading), through a symlink only to a file inside the run, at most
:data:`LIMIT` bytes. What is skipped or left out is said once per run (one
:class:`hookfit.HookfitWarning` naming the files, lines and values, the first :data:`NOTED` of
them; :attr:`RunInfo.notes`, in ``hookfit runs --json`` too), and the other runs are listed as
usual. A run that is still running may be caught in the middle of a line: its cut last line is
skipped without a note. The metrics are read along the line the run followed (:func:`followed`):
rows that a resume abandoned are not the run's, nor those of an earlier history in the folder
(:func:`current`), nor a resume after which nothing was left to do (:func:`resumed_from`).
``Loop.validate()`` records in the folder are not fits, and a folder of them alone (a test
``Loop`` without ``run_dir``) is no training run (:attr:`RunInfo.evaluation`, :func:`find`); it is
judged with the directions of the run whose checkpoint it read as well (:func:`evaluated_directions`).

Which metric a run is judged by and which of its values is best: :mod:`hookfit.tools.metric_rows`.
A run's final value is the last value of that metric; where a stop cut that stage short (an
interrupted run's last epoch, ``"stopped"``) it is the mean over the batches the stage ran, said so
(:attr:`RunInfo.partial`, :data:`PARTIAL`), never the best (over whole epochs).

A run with no end line is *running* while the process that started it is alive on this
machine, *unfinished* otherwise (killed, or on another machine that cannot be asked). A run's
epochs are those the end line of its last ``fit()`` counts (``run.jsonl``'s, else the metric log's:
the epoch it ended in, from 1, as the console prints it, whatever its status, an epoch that a stop,
a failure or an abort cut short included), else, with no end line, the epochs of its metric log.
Its steps are those the end line of its last ``fit()`` in ``run.jsonl`` counts, else the last line
of its metric log: a log that a full disk cut short counts fewer than the run made.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from hookfit.errors import HookfitWarning
from hookfit.tools import jsonlines
from hookfit.tools.ends import alive, end_of_last_fit, ended_best, ended_epochs
from hookfit.tools.jsonlines import LIMIT, checked, read_bytes, read_jsonl, read_metrics
from hookfit.tools.metric_rows import (ROW_FIELDS, best, cut_short, default_metric, direction, directions, final,
                                       finite, metric_names, series, series_names)

__all__ = ["LIMIT", "PARTIAL", "ROW_FIELDS", "RunInfo", "best", "checked", "current", "default_metric", "direction",
           "directions", "epoch_rows", "evaluated_directions", "final", "find", "followed", "load", "metric_names",
           "read_bytes", "read_jsonl", "read_metrics", "resumed_from", "run_folders", "series",
           "series_names", "trained_directions"]

Line = TypeVar("Line", bound=Mapping[str, Any])

PARTIAL = ("(partial: FINAL of a run stopped inside an epoch is the mean over the batches that epoch ran, "
           "not a whole epoch's as BEST is)")
"""What ``hookfit runs`` and ``hookfit compare`` say under their table where a FINAL is marked ``(partial)``."""


def current(lines: Iterable[Line]) -> list[Line]:
    """The lines of the folder's current history: from the last line that begins one, a
    ``"start"`` line in ``metrics.jsonl``, in ``run.jsonl`` the ``"run"`` line of a fit that
    does not resume (``"resume": null``). A script run again in its ``run_dir`` without resume
    begins a new history; the earlier one stays in the files, unread."""
    lines = list(lines)
    begins = [i for i, line in enumerate(lines) if line.get("event") == "start" or (
        line.get("event") == "run" and line.get("mode", "fit") == "fit" and line.get("resume", "") is None)]
    return lines[begins[-1]:] if begins else lines


def followed(lines: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl`` along the line the run followed: a ``"resume"`` line
    at step S drops the ``"epoch"`` and ``"step"`` rows before it past step S (a continuation
    the resume abandoned); those at or before S stay (the validations inside an epoch), but an
    ``"epoch"`` row after a resume replaces those of its stage and epoch that a stop cut short
    (``"stopped"``), of its step (a validation run again) or of training (written again, whole). The
    lines of evaluations (``Loop.validate()``, ``"evaluation": true``) are left out where the
    folder holds a fit's: an evaluation in the run's folder is not a resume of it. Only the
    current history's lines (:func:`current`)."""
    lines = current(lines)
    if not all(line.get("evaluation") for line in lines):
        lines = [line for line in lines if not line.get("evaluation")]
    out: list[dict[str, Any]] = []
    mark = 0  # rows before the last resume line
    for line in lines:
        step = line.get("step")
        if line.get("event") == "resume" and finite(step):
            out = [r for r in out if r.get("event") not in ("epoch", "step") or not finite(r.get("step"))
                   or r["step"] <= step]
            mark = len(out)
        elif line.get("event") == "epoch" and mark:
            key = (line.get("stage"), line.get("epoch"))
            kept = [r for r in out[:mark] if r.get("event") != "epoch" or (r.get("stage"), r.get("epoch")) != key
                    or not (r.get("stopped") or r.get("step") == step or key[0] == "train")]
            out, mark = kept + out[mark:], len(kept)
        out.append(dict(line))
    return out


def is_run(folder: Path) -> bool:
    """Whether ``folder`` is a run folder: it has a ``run.jsonl`` or a ``metrics.jsonl``, of
    whatever kind (one that cannot be read is skipped when the run is read, with a note)."""
    return any(os.path.lexists(folder / name) for name in ("run.jsonl", "metrics.jsonl"))


def run_folders(root: Path) -> list[Path]:
    """The run folders at or under ``root`` (``runs/``, ``runs/<name>`` or a run folder), newest first."""
    if is_run(root):
        return [root]
    found = {p.parent for pattern in ("*/run.jsonl", "*/*/run.jsonl", "*/metrics.jsonl", "*/*/metrics.jsonl")
             for p in root.glob(pattern)}
    return sorted(found, key=_started_key, reverse=True)


def _started_key(folder: Path) -> tuple[str, float]:
    starts = [r.get("started") for r in current(read_jsonl(folder / "run.jsonl")) if r.get("event") == "run"]
    first = next((s for s in starts if isinstance(s, str)), "")
    try:
        mtime = folder.stat().st_mtime
    except OSError:
        mtime = 0.0
    return first, mtime


def find(source: str | os.PathLike[str] | None, root: Path = Path("runs")) -> Path:
    """The run folder ``source`` names: a run folder; a folder of runs, or a run name under
    ``root`` (its newest training run); ``None``: the newest training run under ``root``. A
    folder of evaluations alone (:attr:`RunInfo.evaluation`) is found only where it is named."""
    path = root if source is None else Path(source)
    if source is not None and not path.exists() and (root / path).exists():
        path = root / path
    candidates = run_folders(path) if path.is_dir() else []
    if not candidates:
        raise FileNotFoundError(
            f"no runs in {root}/ (run a training script first, or name a run folder)" if source is None else
            f"{source}: no such run folder" if not path.exists() else
            f"{source}: not a run folder (no run.jsonl or metrics.jsonl in it or below)")
    with warnings.catch_warnings():  # (what is damaged is said where the run found is read)
        warnings.simplefilter("ignore", HookfitWarning)
        found = path if candidates == [path] else next((f for f in candidates if not load(f).evaluation), None)
    if found is None:
        raise FileNotFoundError(f"{path}: evaluations only, no training run (name one to show it: {candidates[0]})")
    return found


def epoch_rows(folder: Path) -> list[dict[str, Any]]:
    """The ``"epoch"`` rows of the run's ``metrics.jsonl``, along the line the run followed
    (:func:`followed`), damaged ones skipped and damaged values left out (:func:`read_metrics`;
    :func:`load` says which)."""
    return [r for r in followed(read_metrics(folder / "metrics.jsonl")) if r.get("event") == "epoch"]


@dataclass(frozen=True)
class RunInfo:
    """One run folder, summed up: what ``hookfit runs`` lists.

    ``status`` is the last ``fit()``'s (``completed``, ``interrupted``, ``failed``), or
    ``running`` / ``unfinished`` when it wrote no end (see the module's documentation);
    ``duration`` adds up its ``fit()`` calls; ``epochs`` is the epoch it ended in (see the
    module's documentation); ``best`` is ``(metric, value, epoch)``, ``None``
    when the metric has no finite value or no direction; ``mode`` that direction (``"min"``,
    ``"max"``, ``None``: unknown); ``resumed_from`` the checkpoint of the last resume the run
    went on from (:func:`resumed_from`); ``evaluation``, ``evaluated``: below."""

    folder: str
    name: str
    started: str | None
    duration: float | None
    status: str
    reason: str | None
    epochs: int | None
    steps: int | None
    best: tuple[str, float, int] | None
    resumed_from: str | None
    fits: int
    metric: str | None = None
    mode: str | None = None
    identity: str | None = None
    """What ``resume="latest"`` matches (the script's path, a notebook's...: see
    :mod:`hookfit.records`), ``None`` for a run recorded before identities were."""
    notes: tuple[str, ...] = ()
    """What was skipped or left out reading the run's files and why (its files are damaged or
    cannot be read), one entry a file; said once in a warning as well."""
    evaluation: bool = False
    """The folder holds evaluations alone (``Loop.validate()``): status ``evaluated`` once the last
    one completed, no epochs, steps, fits nor resume."""
    evaluated: str | None = None
    """The checkpoint the last evaluation read (``None``: the model as it was given)."""
    final: tuple[float, int] | None = None
    """The last value of :attr:`metric` and its epoch: NaN or infinite where the run diverged."""
    diverged: int | None = None
    """The epoch from which :attr:`metric` is NaN or infinite to its last value, ``None`` when that is finite."""
    partial: bool = False
    """:attr:`final` is of a stage a stop cut short (an interrupted run's last epoch): the mean over
    the batches that stage ran, not over a whole epoch as :attr:`best` and other runs' values are.
    ``hookfit runs`` and ``hookfit compare`` write it ``(partial)``."""

    def as_dict(self) -> dict[str, Any]:
        """As ``hookfit runs --json`` writes it: JSON, a final value that is not finite as ``"nan"``,
        ``"inf"`` or ``"-inf"``, and whether it is :attr:`partial` in ``"final"``."""
        out = asdict(self)
        del out["partial"]  # (said in "final")
        out["best"] = None if self.best is None else dict(zip(("metric", "value", "epoch"), self.best))
        if self.final is not None:
            value = self.final[0] if math.isfinite(self.final[0]) else str(self.final[0])
            out["final"] = {"metric": self.metric, "value": value, "epoch": self.final[1], "partial": self.partial}
        return out


def resumed_from(lines: Iterable[Mapping[str, Any]]) -> str | None:
    """The checkpoint (``"from"``) of the last ``"resume"`` line of a ``metrics.jsonl`` that the
    run went on from, ``None`` without one: one after which, before the next, the run wrote a
    metrics row (a stage it ran), or an end or checkpoint line past its step (a run resumed once
    it had ended, with nothing left to do, writes its end line alone)."""
    found: Mapping[str, Any] | None = None
    pending: Mapping[str, Any] | None = None
    for line in lines:
        event, step = line.get("event"), line.get("step")
        if pending is not None and (event in ("epoch", "step") or event in ("end", "checkpoint") and finite(step)
                                    and not (finite(pending.get("step")) and step <= pending["step"])):
            found, pending = pending, None
        pending = line if event == "resume" else pending
    return None if found is None else str(found.get("from"))


def evaluated_directions(own: Mapping[str, str], checkpoint: str | None) -> dict[str, str]:
    """The directions an evaluation is judged by: its own (``own``, :func:`directions`), then those of
    the training run whose checkpoint it read (``checkpoint``, in that run folder's ``checkpoints/``),
    which its own do not name: an evaluation of a run that ranked by ``valid/acc``
    (``Metrics(best={"valid/acc": "max"})``) ranks by it too, though the evaluating ``Loop``'s
    metrics plugin was given no direction. Only what that run's log says; ``own`` alone without it."""
    known = dict(own)
    for name, mode in trained_directions(checkpoint).items():
        known.setdefault(name, mode)
    return known


def trained_directions(checkpoint: str | os.PathLike[str] | None) -> dict[str, str]:
    """The directions (:func:`directions`) the log of the training run whose checkpoint ``checkpoint``
    is (a file in that run folder's ``checkpoints/``) records, ``{}`` for a checkpoint in no run folder."""
    path = Path(checkpoint) if checkpoint else None
    folder = path.parent.parent if path is not None and path.parent.name == "checkpoints" else None
    if folder is None or not is_run(folder):
        return {}
    return directions(followed(read_metrics(folder / "metrics.jsonl")))  # (its damage is said where that run is read)


def fit_lines(lines: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The lines of a ``run.jsonl``'s current history (:func:`current`) without those of
    evaluations (``"run"`` lines with ``"mode": "validate"`` and the ``"end"`` line after each)."""
    out, evaluating = [], False
    for line in current(lines):
        if line.get("event") == "run":
            evaluating = line.get("mode", "fit") != "fit"
        if not evaluating:
            out.append(line)
    return out


def load(folder: Path, metric: str | None = None, mode: str | None = None) -> RunInfo:
    """What ``folder``'s files say of the run: the fits of ``Loop.fit()`` (an evaluation,
    ``Loop.validate()``, in the same folder is not one), and its metrics along the line it
    followed (:func:`followed`). A file that cannot be read is skipped, with one
    :class:`hookfit.HookfitWarning` for the run naming what and why."""
    notes: list[str] = []
    lines = list(read_jsonl(folder / "run.jsonl", notes))
    starts_and_ends = fit_lines(lines)
    evaluation = not any(r.get("event") == "run" for r in starts_and_ends)
    if evaluation:  # no fit: a folder of evaluations alone (their lines), or one without a run.jsonl
        starts_and_ends = current(lines)
    starts = [r for r in starts_and_ends if r.get("event") == "run"]
    live = bool(starts) and end_of_last_fit(starts_and_ends) is None and alive(starts[-1])
    metrics = followed(read_metrics(folder / "metrics.jsonl", notes, live=live))
    if notes:
        warnings.warn(f"hookfit runs: {folder}: {'; '.join(notes)}", HookfitWarning, stacklevel=2)
    evaluation = evaluation and (bool(starts) or bool(metrics) and all(r.get("evaluation") for r in metrics))
    ends = [r for r in metrics if r.get("event") == "end"]
    core_ends = [r for r in starts_and_ends if r.get("event") == "end"]
    rows = [r for r in metrics if r.get("event") == "epoch"]
    ended = core_ends or ends  # the core's end lines, else the metrics plugin's
    fits = max(len(starts), len(ended), 1 if metrics else 0)
    # the last fit() decides: its own end line (after its start line in run.jsonl); an earlier
    # fit() that was killed wrote none, and a resumed one that ended says how the run ended
    last_end = end_of_last_fit(starts_and_ends) if starts else (ended[-1] if ended else None)
    if not core_ends and ended and len(ended) >= len(starts):
        last_end = ended[-1]  # a run.jsonl without end lines: the metrics log's
    if last_end is not None:
        status, reason = str(last_end.get("status")), last_end.get("reason")
    elif starts and alive(starts[-1]):
        status, reason = "running", None
    else:
        status, reason = "unfinished", "no end was recorded (killed, or still running elsewhere)"
    durations = [d for r in ended if isinstance(d := r.get("duration", r.get("time")), (int, float))]
    duration = sum(durations) if durations else None  # (None: no fit's duration is known)
    since = metrics[max((i for i, r in enumerate(metrics) if r.get("event") == "resume"), default=0):]  # the last fit's
    epochs = max((int(r["epoch"]) for r in rows if isinstance(r.get("epoch"), int)), default=None)
    steps = max((r["step"] for r in since if r.get("event") in ("epoch", "step", "end", "checkpoint", "resume")
                 and jsonlines.count(r.get("step"))), default=None)
    epochs = ended_epochs(last_end) or epochs  # the epoch it ended in (a partial one too), as the console counts
    counted = last_end.get("steps") if last_end is not None else None  # the core's end line (run.jsonl)
    short = jsonlines.count(counted) and (steps is None or counted > steps)
    if short:  # the metric log stopped short (a full disk)
        steps = counted
    read: list[Any] = []  # what an evaluation read: its resume lines, else the checkpoints it was given
    if evaluation:
        read = [r.get("from") for r in metrics if r.get("event") == "resume"] or [r.get("resume") for r in starts]
    known = evaluated_directions(directions(metrics), read[-1] if read and isinstance(read[-1], str) else None)
    metric = metric or default_metric(rows, known)
    mode = mode or (direction(metric, known) if metric else None)
    found = best(rows, metric, mode) if metric and mode else None
    last, diverged = final(rows, metric) if metric else (None, None)
    if short and metric and mode == direction(metric, directions(metrics)):  # the run's own best of every epoch
        found = ended_best(last_end, metric) or found
    name = starts[-1].get("name") if starts else None
    name = name if isinstance(name, str) else folder.parent.name  # (a damaged name is left out)
    started = starts[0].get("started") if starts else None
    identity = starts[0].get("identity") if starts else None
    if evaluation:
        status, epochs, steps, fits = "evaluated" if status == "completed" else status, None, None, 0
    return RunInfo(
        folder=str(folder), name=str(name), started=started if isinstance(started, str) else None,
        duration=duration, status=status, reason=reason, epochs=epochs, steps=steps,
        best=None if found is None or metric is None else (metric, found[0], found[1]),
        resumed_from=None if evaluation else resumed_from(metrics), fits=fits, metric=metric, mode=mode,
        identity=identity if isinstance(identity, str) else None, notes=tuple(notes), evaluation=evaluation,
        evaluated=read[-1] if read and isinstance(read[-1], str) else None, final=last, diverged=diverged,
        partial=last is not None and metric is not None and cut_short(rows, metric),
    )
