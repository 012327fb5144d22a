"""checkpoint catalog: the checkpoints a run keeps. The files still on disk (oldest first),
the last one and the best by a monitored metric, and which files to remove so that at most
``keep_last`` remain besides the ``keep_best`` best-scored ones. The files are removed by the writer
(:mod:`hookfit.plugins.checkpoint.writer`); this part only decides."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from hookfit.plugins.checkpoint.storage import ASIDE, listed, position_of, score_of
from hookfit.plugins.support import Monitor

__all__ = ["Catalog"]


def _at(path: str | os.PathLike[str]) -> Path:
    """A checkpoint's path as the catalog keeps it: absolute, so that one file written two ways is one."""
    return Path(os.path.abspath(path))


def _moved(source: Path | None) -> Callable[[str | os.PathLike[str]], Path]:
    """A path a checkpoint at ``source`` names, as the catalog keeps it (:func:`_at`): where ``source`` lies in an
    ``earlier-run-N/`` subfolder, a path in the folder above it is read as the one of that name beside ``source``,
    unless none lies there and the folder above lists that name (:data:`~hookfit.plugins.checkpoint.storage.EARLIER`):
    a checkpoint of the earlier run that could not be moved aside, where it was written."""
    if source is None or not ASIDE.fullmatch((home := _at(source).parent).name):
        return _at
    stuck = listed(home.parent)

    def at(path: str | os.PathLike[str]) -> Path:
        path = _at(path)
        if path.parent != home.parent or (path.name in stuck and not os.path.lexists(home / path.name)):
            return path
        return home / path.name

    return at


class Catalog:
    """The checkpoints a run keeps (see the module); ``monitor`` keeps the best."""

    def __init__(self, keep_last: int, monitor: Monitor, keep_best: int = 1) -> None:
        if keep_best > 1 and monitor.metric is None:
            raise ValueError(f"checkpoint: keep_best={keep_best} keeps the checkpoints best by monitor, and none is "
                             f"given: give monitor='valid/loss' (the metric they are compared on), or leave "
                             f"keep_best out")
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor = monitor
        self.saved: list[Path] = []
        """This run's checkpoints still on disk, oldest first."""
        self.scores: dict[Path, float] = {}
        """The monitored metric of each checkpoint on disk that has one (a finite value)."""
        self.last: Path | None = None
        """The newest checkpoint of the run: the last written whole, else the one it resumed
        from; a ``failed-*`` file is not counted."""
        self.reading: Path | None = None
        """The checkpoint whose state :meth:`load` is given (``None``: not known)."""

    @property
    def best(self) -> tuple[float, Path] | None:
        """``(its metric, its path)`` of the best checkpoint by the monitor, or ``None``."""
        return self.monitor.record

    @best.setter
    def best(self, best: tuple[float, Path] | None) -> None:
        self.monitor.reset(*(best or ()))

    def reset(self) -> None:
        """A new run: nothing kept yet."""
        self.saved, self.best, self.last, self.scores, self.reading = [], None, None, {}, None

    def follow(self, path: Path, metric: float | None, reason: str) -> None:
        """Take ``path``, a checkpoint written whole (by this process, or by the main one),
        as the last, and as the best if its metric improves on the best."""
        if reason == "failure":
            return
        self.last = path = _at(path)
        if metric is not None and self.monitor.metric is not None:
            self.monitor.update(metric, at=path)
            if math.isfinite(metric):  # NaN and infinities are never kept as best
                self.scores[path] = metric

    def ranks(self, score: float | None) -> bool:
        """Whether a checkpoint scored ``score`` would be among the ``keep_best`` (more than one) kept."""
        if self.keep_best < 2 or score is None or not math.isfinite(score):
            return False
        better = self.monitor.mode == "max"
        ranked = sorted((self.scores[p] for p in self.saved if p in self.scores), reverse=better)
        return len(ranked) < self.keep_best or (score > ranked[-1] if better else score < ranked[-1])

    def take(self, path: Path, metric: float | None, reason: str) -> list[Path]:
        """A checkpoint this process wrote whole: kept (last, best), and the files to remove now."""
        if reason == "failure":
            return []
        path = _at(path)
        if path in self.saved:  # the same position written again
            self.saved.remove(path)
        self.saved.append(path)
        self.follow(path, metric, reason)
        return self.prune()

    def prune(self) -> list[Path]:
        """Drop what is beyond ``keep_last`` and the ``keep_best`` best (the best kept) from the list; the files to
        remove."""
        ranked = sorted((p for p in self.saved if p in self.scores), key=self.scores.__getitem__,
                        reverse=self.monitor.mode == "max")
        keep = {*self.saved[-self.keep_last:], *ranked[:self.keep_best]}
        if self.best is not None:
            keep.add(self.best[1])
        old = [p for p in self.saved if p not in keep]
        self.saved = [p for p in self.saved if p in keep]
        for path in old:
            self.scores.pop(path, None)
        return old

    def keep(self, path: Path) -> None:
        """A file that could not be removed: on the list again, the oldest, tried again at the next prune."""
        self.saved.insert(0, _at(path))

    def adopt(self, files: list[Path], step: int) -> list[Path]:
        """Take ``files`` (the checkpoints in this run's folder) as this run's, resumed from
        one at ``step``, so ``keep_last`` holds across resumes: sorted by position, those beyond
        ``step`` (an abandoned continuation) first, so pruned first; the files to remove. The scores of
        those up to ``step`` that the state lacks are read from them, and a better one is the best: the state a
        checkpoint holds is copied before the writes still in flight then are taken (a background writer), and a
        state may be older than the scores it keeps."""
        files = sorted(map(_at, files), key=lambda p: (position_of(p)[0] <= step, position_of(p), p.stat().st_mtime))
        self.saved = files
        if self.monitor.metric is not None:
            for path in files:
                if path not in self.scores and position_of(path)[0] <= step:
                    if (score := score_of(path, self.monitor.metric)) is not None:
                        self.scores[path] = score
                        self.monitor.update(score, at=path)
        return self.prune()

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds of this (the plugin's ``save_state``): taken before the file it is
        saved in is written, so its best is the one before that file (see :meth:`resumed`)."""
        best = None if self.best is None else [self.best[0], str(self.best[1])]
        return {"best": best, "mode": self.monitor.mode, "saved": [str(p) for p in list(self.saved)],
                "scores": {str(p): value for p, value in list(self.scores.items())}, "monitor": self.monitor.metric}

    def load(self, state: Mapping[str, Any]) -> None:
        """Back from :meth:`state`, for the files still on disk; the direction the best was found in. Read from a
        checkpoint (:attr:`reading`) that a later run moved aside into an ``earlier-run-N/`` subfolder of the folder
        it was written in, the files the state names in that folder are read as the ones moved beside it (the
        names there now are the later run's)."""
        at = _moved(self.reading)
        same = state.get("monitor", self.monitor.metric) == self.monitor.metric  # (a state before it was kept: same)
        best = state.get("best") if same else None  # a best by another metric is none by this one
        value, path = best if best is not None and at(best[1]).exists() else (None, None)
        self.monitor.reset(value, None if path is None else at(path), state.get("mode"))
        self.saved = [at(p) for p in state.get("saved", []) if at(p).exists()]
        self.scores = {at(p): float(v) for p, v in dict(state.get("scores") or {} if same else {}).items()
                       if at(p) in self.saved}

    def resumed(self, path: Path, meta: Any, training: bool, state: Any = None) -> Path:
        """The run resumed from ``path``: the last and, in a training run, the best if its own score
        (``meta["metric"]``, of the metric monitored here) improves on the best its state named. A run
        killed right after writing its best checkpoint would else take a worse one for the best, and
        prune the best weights away. In an evaluation (not ``training``), the best of the run that wrote
        ``path`` as ``path`` knows it, by the monitor that run recorded (``meta["monitor"]``; its catalog's
        ``state``), ``path`` itself where its own score is better: after ``resume="best"``, ``path``. Where the
        best it recorded is gone, ``path`` only where its own score is better than that best's, else ``None``
        (``hookfit export --best`` names no best there either)."""
        if not training:
            self.best = None
            if isinstance(meta, Mapping) and isinstance(monitor := meta.get("monitor"), str):
                run = Catalog(1, Monitor(monitor))
                run.reading = path
                run.load(state := state if isinstance(state, Mapping) else {})
                recorded = state.get("best")
                if (run.best is None and isinstance(recorded, (list, tuple)) and len(recorded) == 2
                        and isinstance(recorded[0], (int, float)) and state.get("monitor", monitor) == monitor):
                    run.monitor.reset(recorded[0], None, state.get("mode"))  # its file gone: compared, never named
                run.resumed(path, meta, True)
                self.best = run.best if run.best is not None and run.best[1] is not None else None
        self.last = path = _at(path)
        metric = meta.get("metric") if isinstance(meta, Mapping) else None
        if (training and isinstance(metric, (int, float)) and meta.get("monitor") == self.monitor.metric
                and meta.get("reason") != "failure"):  # (a failed-*.pt file is never the best, as in follow)
            self.follow(path, float(metric), "resume")
        return path
