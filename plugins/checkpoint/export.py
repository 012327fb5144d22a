"""``hookfit export RUN model.pt``: the model of a run's latest checkpoint (or of a given one),
sharded or not, as one plain state dict that ``torch.load`` and ``load_state_dict`` take: the
plain module's keys, even from a checkpoint written from a ``torch.compile``d model before its
wrapper was looked through (``_orig_mod.``-prefixed keys).

``hookfit export RUN model.pt --weights NAME`` writes instead the weights that plugin ``NAME``
keeps in the checkpoint (``--weights ema``: the ema plugin's average), laid out as the model
would be. A plugin offers weights to export by its saved state alone (``save_state``), with no
knowledge of this command: a mapping whose :data:`WEIGHTS` entry is a state dict of the run's
model as one module (several models as a ``ModuleDict`` or ``ModuleList`` of them holds them:
``"<name>."`` or ``"<index>."`` before each model's keys), or of some of several models (those
alone are written: a dict of them, by name or by list position). Its keys must be the model's,
or nothing is written. Exporting the model names the plugins whose weights the checkpoint also
holds.

``hookfit export RUN model.pt --best`` takes the run's best checkpoint by the metric its
checkpoints were scored on (``Checkpoint(monitor=...)``) instead of its newest: the best its
newest checkpoint records, or that checkpoint itself where its own score is better (a
checkpoint's record is taken before it is written)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hookfit.plugins.checkpoint import sharded
from hookfit.plugins.checkpoint.catalog import Catalog
from hookfit.plugins.checkpoint.storage import CheckpointError, atomic_save, checkpoint_files, read, tag_of
from hookfit.plugins.support import Monitor, unwrap_state_dict

WEIGHTS = "state_dict"
"""The entry of a plugin's saved state that offers weights to ``hookfit export --weights``
(see the module documentation)."""


class Exported(NamedTuple):
    """What :func:`export` wrote: from which checkpoint, whose weights (``None``: the model's)
    and the plugins whose weights that checkpoint also offers."""

    checkpoint: Path
    weights: str | None
    offered: tuple[str, ...]
    best: tuple[str, float] | None = None  # with --best: the metric and the checkpoint's score


def find(source: str | os.PathLike[str]) -> Path:
    """The checkpoint ``source`` names: a checkpoint (a file, or a sharded checkpoint's
    folder), or the newest in a folder of checkpoints or in a run folder's ``checkpoints``."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"hookfit export: {path}: no such checkpoint or run folder")
    if path.is_file() or sharded.is_sharded(path):
        return path
    for folder in (path / "checkpoints", path):
        found = checkpoint_files(folder)
        if found:
            return found[0]
    raise FileNotFoundError(f"hookfit export: no checkpoint in {path} (nor in {path / 'checkpoints'})")


def best(source: str | os.PathLike[str], asked: str = "hookfit export --best",
         instead: str = "export the newest (without --best)") -> tuple[Path, str, float]:
    """The best checkpoint of the run whose newest checkpoint ``source`` names (:func:`find`), the
    metric it was scored on and its score: the best that checkpoint's state records, or the
    checkpoint itself where its own score is better (:meth:`Catalog.resumed`). Errors say ``asked``
    (what the user asked for) and ``instead`` (what else to do)."""
    newest = find(source)
    data = read(newest)
    meta, states = data.get("meta"), data.get("plugins")
    monitor = meta.get("monitor") if isinstance(meta, Mapping) else None
    state = states.get("checkpoint") if isinstance(states, Mapping) else None
    if not isinstance(meta, Mapping) or not isinstance(monitor, str) or not isinstance(state, Mapping):
        raise CheckpointError(f"{asked}: the run of {newest} scored no checkpoint (no Checkpoint(monitor=...)), so "
                              f"none is its best: {instead}, or a checkpoint by its path")
    recorded = state.get("best")
    if isinstance(recorded, (list, tuple)) and len(recorded) == 2:  # by name beside the newest where it is of the
        # newest's run (its tag: a folder moved or set aside since), else where it was written (a run resumed from
        # a checkpoint elsewhere, its best there)
        beside = newest.parent / Path(str(recorded[1])).name
        found = [p for p in ((beside,) if tag_of(beside) == tag_of(newest) else ()) + (Path(str(recorded[1])),)
                 if p.is_file() or sharded.is_sharded(p)]
        own = meta.get("metric") if isinstance(meta.get("metric"), (int, float)) else None
        if not found and (own is None or not _improves(monitor, state.get("mode"), own, float(recorded[0]))):
            raise CheckpointError(f"{asked}: the best checkpoint the run of {newest} recorded, {recorded[1]} (its "
                                  f"{monitor} {recorded[0]}), is gone: {instead}, or a checkpoint by its path")
        state = {**state, "best": [recorded[0], str(found[0])] if found else None}  # (gone: the newest is better)
    catalog = Catalog(1, Monitor(monitor))
    catalog.load(state)
    catalog.resumed(newest, meta, training=True)
    if catalog.best is None:
        raise CheckpointError(f"{asked}: no checkpoint of the run of {newest} has a score of {monitor} (none was "
                              f"saved after a validation of it): {instead}, or a checkpoint by its path")
    score, path = catalog.best
    beside = newest.parent / path.name  # (named as the newest is: relative where the source is)
    return beside if beside.absolute() == path.absolute() else path, monitor, score


def _improves(metric: str, mode: Any, value: float, best: float) -> bool:
    monitor = Monitor(metric, mode if mode in ("min", "max") else None)
    monitor.reset(best)
    return monitor.improves(value)


def export(source: str | os.PathLike[str], out: str | os.PathLike[str], weights: str | None = None,
           best_of_run: bool = False) -> Exported:
    """Write the model of the checkpoint that ``source`` names (see :func:`find`; with
    ``best_of_run``, the best of that run: :func:`best`) to ``out`` as a plain state dict (every
    tensor whole, on the CPU), atomically; with ``weights``, the weights that plugin offers in it
    instead (see the module documentation). Runs in one process: a sharded checkpoint's tensors
    are read whole. ``out`` may not be the checkpoint itself nor inside its folder: that would
    replace what the run resumes from, nor a folder."""
    scored = best(source) if best_of_run else None
    path = scored[0] if scored is not None else find(source)
    _refuse_input(Path(out), path)
    if Path(out).is_dir() or str(out).endswith(("/", os.sep)):
        raise CheckpointError(f"hookfit export: {out} is a folder; give the file to write in it, such as "
                              f"{Path(out) / 'model.pt'}")
    data = read(path)
    if sharded.placeholders(data):
        data = sharded.load(data, path, None)
    model = data["model"]
    if model is None:
        raise CheckpointError(f"hookfit export: {path} holds no model")
    model = _plain(model)
    offers = offered(data)
    if weights is not None:
        model = _offered(data, weights, offers, model, path)
    atomic_save(model, Path(out))
    return Exported(path, weights, tuple(offers), None if scored is None else scored[1:])


def offered(data: Mapping[str, Any]) -> list[str]:
    """The plugins whose saved state in checkpoint ``data`` offers weights to export."""
    states = data.get("plugins")
    if not isinstance(states, Mapping):
        return []
    return [str(name) for name, state in states.items()
            if isinstance(state, Mapping) and isinstance(state.get(WEIGHTS), Mapping)]


def _offered(data: Mapping[str, Any], name: str, offers: list[str], model: Any, path: Path) -> Any:
    """Plugin ``name``'s weights in checkpoint ``data``, laid out as ``model`` (its plain
    state: one state dict, or a dict or a list of them) and with its keys."""
    where = f"hookfit export --weights {name}: {path}"
    others = f"plugins whose weights it holds: {', '.join(map(repr, offers))}" if offers else "no plugin's weights"
    if name not in offers:
        states = data.get("plugins")
        if not isinstance(states, Mapping) or states.get(name) is None:
            raise CheckpointError(f"{where} holds no saved state of plugin {name!r} ({others})")
        raise CheckpointError(f"{where}: plugin {name!r}'s saved state offers no weights (no {WEIGHTS!r} entry "
                              f"with a state dict; {others})")
    weights = unwrap_state_dict(data["plugins"][name][WEIGHTS])
    if isinstance(model, list) or _several(model):
        models = dict(enumerate(model)) if isinstance(model, list) else dict(model)
        laid: Any = {key: _part(weights, f"{key}.") for key in models}
        if any(laid.values()):  # weights of some of the models only (an average of one optimizer's): those
            laid = {key: part for key, part in laid.items() if part}
        pairs = [(f"[{key!r}]", part, models[key]) for key, part in laid.items()]
        if isinstance(model, list) and len(laid) == len(model):
            laid = list(laid.values())
    else:
        laid, pairs = weights, [("", weights, model)]
    for label, got, expected in pairs:
        if set(got) != set(expected):
            missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
            raise CheckpointError(
                f"{where}: plugin {name!r}'s weights do not have the keys of the model{label} "
                f"(missing {missing[:3]}, unexpected {extra[:3]}): nothing was written")
    return laid


def _part(weights: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """One model's entries of a container's state dict, without their ``prefix``."""
    return unwrap_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})


def _several(state: Any) -> bool:
    """Whether a checkpoint's model state is a dict of models (rather than one state dict)."""
    return isinstance(state, Mapping) and any(isinstance(value, (Mapping, list)) for value in state.values())


def _plain(state: Any) -> Any:
    """A checkpoint's model state with ``torch.compile``'s ``_orig_mod.`` taken off the keys
    (:func:`~hookfit.plugins.support.unwrap_state_dict`) of every module's state dict: of the
    model, or of each model of a dict or a list of them."""
    if isinstance(state, Mapping):
        state = unwrap_state_dict(state)
        if _several(state):
            return {key: _plain(value) for key, value in state.items()}
        return state
    if isinstance(state, list):
        return [_plain(value) for value in state]
    return state


def _refuse_input(out: Path, checkpoint: Path) -> None:
    """A :class:`CheckpointError` when writing ``out`` would change ``checkpoint`` (the same
    file or folder, by name or by a link, or a file inside a sharded checkpoint's folder)."""
    target, used = out.resolve(), checkpoint.resolve()
    same = target == used or used in target.parents
    if not same and out.exists():
        try:
            same = os.path.samefile(out, checkpoint)
        except OSError:
            pass
    if same:
        where = "is the checkpoint it would read" if target == used else "is inside the checkpoint it would read"
        raise CheckpointError(
            f"hookfit export: {out} {where} ({checkpoint}): writing the plain state dict there would replace "
            f"the checkpoint (the run could no longer resume from it); give another file, such as model.pt")
