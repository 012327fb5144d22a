"""ema: an exponential moving average of the model's weights, validated with and saved.

``EMA(decay=0.999, every_n_steps=1, validate=True, optimizer=None)`` in ``Loop(plugins=[...])``.
Discovered like every plugin, it is inert until given a ``decay``: without one it is left out
of the run before ``configure`` (given without one, it warns and unregisters itself there), so
no hook of it runs and the optim plugin keeps its fast path.

* The average is PyTorch's own :class:`torch.optim.swa_utils.AveragedModel` with
  ``get_ema_multi_avg_fn(decay)`` and ``use_buffers=True`` (batch-norm statistics are
  averaged too), a copy of ``loop.model`` made at ``fit_start``: of the module inside a
  ``DistributedDataParallel`` wrapper under ``torchrun`` or a ``torch.compile`` one (so its
  state has the plain module's keys); of the modules of a dict or a list of modules (as a
  ``ModuleDict`` or ``ModuleList``) that the watched optimizer steps: with several optimizers,
  ``EMA(optimizer="gen")`` on ``Loop(model={"gen": G, "disc": D})`` averages ``G`` alone (a
  ``ModuleDict`` of the models that optimizer steps a parameter of, keyed as in the ``Loop``, a
  list's by position). A model is averaged whole, its buffers with it, even where the optimizer
  steps some of its parameters only.
* It is updated after every ``every_n_steps``-th real step of the optimizer (the
  ``after_optimizer_step`` event: calls inside a gradient-accumulation window and steps
  skipped for a non-finite loss do not count). The first update copies the weights, each
  later one makes ``average = decay * average + (1 - decay) * weights`` (a ``lerp``); a buffer
  holding an infinity when the run starts (a ``-inf`` attention or padding mask) is copied from
  the model instead, which averaging would turn into NaN. With
  several optimizers, ``optimizer`` names the one whose steps count. Implementing
  ``after_optimizer_step`` makes the optim plugin fire the events around its steps (its
  slower step path); ``every_n_steps`` spares the update itself, not that.
* With ``validate=True`` the validation stage runs with the averaged weights, as a plugin that
  changes the model for a stage does it (``core/hooks.md``, the order of implementations): they
  are copied into the model after every ``stage_start("valid")`` implementation (a
  ``wrapper=True`` one, after its ``yield``) and the training weights are copied back, bit for
  bit, before every ``stage_end("valid")`` one (before the ``yield`` of a wrapper), so the
  validation's batches, steps and metrics are the averaged model's. They are also copied back
  when validation fails (``exception``) or is stopped (a ``fit_end`` wrapper, before every
  ``fit_end`` implementation: a checkpoint written on a stop during validation holds the training
  weights). With another plugin doing the same (an SWA), the two nest in any registration order:
  validation runs with the weights of the one registered last, and the training weights come back.
  Models the average leaves out keep their training weights there: a GAN validates its averaged
  generator against its trained discriminator. Before the first update, validation uses the
  training weights.
* Its state (the averaged module's state dict, ``n_averaged`` and the optimizer steps
  counted) is saved in checkpoints, so a resumed run ends with the same average, bit for bit,
  as one that was never interrupted (a resumed run goes on with the ``decay`` it is given).
* After ``fit()``, :attr:`EMA.module` is the averaged module (the model itself keeps the
  training weights): ``model.load_state_dict(ema.module.state_dict())`` puts the average in it.
  ``hookfit export RUN model.pt --weights ema`` writes the average of a run's checkpoint (its
  saved state offers it: a ``state_dict`` entry with the model's keys,
  :mod:`hookfit.plugins.checkpoint.export`): of the models it averages only (``{"gen": ...}``).
* In an evaluation (``Loop.validate(resume=...)``, ``loop.mode == "validate"``) it needs no
  optimizer and updates nothing: the average is the checkpoint's, restored by ``load_state``,
  and the validation runs with it (``validate=True``) as a training run's validations did, the
  model's own weights back afterwards. A checkpoint without an average (or before its first
  update) is validated with the training weights, with one warning saying so. Without a
  ``decay`` the plugin stays registered in such an evaluation only to say, in one warning, that
  the checkpoint holds an average and the evaluation uses the training weights, not it, and
  how to validate the average (``EMA(decay=...)``; the decay is not used).
* A run it cannot average fails at ``fit_start``, before any batch, with a ``ValueError``
  saying why: no model, no optimizer plugin announcing steps, several optimizers and none
  named, a named optimizer the run lacks. An optimizer plugin announces steps when it owns the
  backward pass (implements ``backward``) and has put its managed optimizers in
  ``loop.optimizers`` at ``configure``, as the optimizer role does (``core/hooks.md``), so
  that ``loop.optimizers`` is no longer what ``Loop(optimizers=...)`` was given; their type
  does not matter (a replacement's may subclass ``torch.optim.Optimizer``), nor does the
  plugin's name.
"""

from __future__ import annotations

import itertools
import numbers
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from hookfit import hookimpl
from hookfit.config import records_options
from hookfit.errors import HookfitWarning, user_level
from hookfit.manager import chosen
from hookfit.plugins.support import Every, check, flag, unwrap_model, unwrap_state_dict

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run

__all__ = ["EMA"]

_Params = tuple[torch.Tensor, ...] | list[torch.Tensor]
_MultiAvg = Callable[[_Params, _Params, torch.Tensor | int], None]
"""What ``AveragedModel(multi_avg_fn=...)`` takes: it averages the tensors of the first list
with those of the second, in place."""
_ema_multi_avg_fn: Callable[[float], _MultiAvg] = get_ema_multi_avg_fn  # unannotated in torch


@records_options
class EMA:
    """An exponential moving average of the model's weights (see the module documentation).
    Every option is checked here, with a ``ValueError`` naming it; ``decay=None`` (the
    default) leaves the run alone."""

    name = "ema"

    def __init__(self, decay: float | None = None, every_n_steps: int = 1, validate: bool = True,
                 optimizer: str | None = None) -> None:
        name = self.name
        check(name, "decay", decay,
              lambda d: d is None or (not isinstance(d, bool) and isinstance(d, numbers.Real) and 0 < float(d) < 1),
              "be a number with 0 < decay < 1 (like 0.999), or None to switch the plugin off")
        self._updates = Every(every_n_steps, plugin=name, option="every_n_steps", none=False,
                              meaning="optimizer steps")
        flag(name, "validate", validate)
        check(name, "optimizer", optimizer, lambda o: o is None or (isinstance(o, str) and bool(o.strip())),
              "be the name of one of the run's optimizers, or None")
        self.decay = None if decay is None else float(decay)
        self.every_n_steps = every_n_steps
        self.validate = validate
        self.optimizer = optimizer
        self.average: AveragedModel | None = None
        """The :class:`~torch.optim.swa_utils.AveragedModel` of the current or last run
        (``None`` before one, and when inert)."""
        self.steps = 0
        """Real steps of the watched optimizer since the run began (a resumed run goes on from the
        count in its checkpoint): every ``every_n_steps``-th one updates the average."""
        self._source: torch.nn.Module | None = None  # the module (or container) averaged
        self._watched: str | None = None  # the name of the optimizer whose steps count
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (model tensor, training value)
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []  # (averaged, model) buffers copied, not averaged
        self._evaluating = False  # Loop.validate(): the average is the checkpoint's, no optimizer updates it
        self._several = False  # Loop(model={...}) or [...]: only then is the average narrowed to some models

    @property
    def module(self) -> torch.nn.Module | None:
        """The averaged module (a copy of the model; a ``ModuleDict`` or ``ModuleList`` for a
        dict or list of models: of those the watched optimizer steps), or ``None`` before a run."""
        return None if self.average is None else self.average.module

    @property
    def n_averaged(self) -> int:
        """How many times the average was updated (0 before the first update)."""
        return 0 if self.average is None else int(self.average.n_averaged)

    # -- events ---------------------------------------------------------------------------
    def inert(self, chosen: bool, loop: Run | None = None) -> str | None:
        """What ``hookfit plugins`` says of it (:func:`hookfit.discovery.inert`): inert until
        given a ``decay``, but in an evaluation of a checkpoint (``loop``, a run asking), where
        it says whether the checkpoint holds an average it does not validate."""
        if self.decay is not None or (loop is not None and loop.mode == "validate" and loop.resume is not None):
            return None
        return ("given a decay: EMA(decay=0.999) in Loop(plugins=[...]), or decay = 0.999 in [plugins.ema] of "
                "hookfit.toml")

    @hookimpl
    def configure(self, loop: Run) -> None:
        self.average, self._source, self._watched, self._kept, self.steps = None, None, None, None, 0
        self._copied, self._several = [], False
        self._evaluating = loop.mode == "validate"
        if self._evaluating and loop.resume is not None and self.decay is None:
            return  # averages nothing: only says so if the checkpoint holds an average (load_state)
        if (how := self.inert(True)) is not None:
            if chosen(loop.pm, self):  # asked for, and it would do nothing: say so
                warnings.warn(f"ema: chosen for this run but without a decay it averages nothing; it is inert "
                              f"until {how}", HookfitWarning, stacklevel=user_level())
            loop.pm.unregister(self)  # inert: none of the hooks below costs anything

    @hookimpl
    def fit_start(self, loop: Run) -> None:
        decay = self.decay
        if decay is None:  # an evaluation's, kept by configure to say what it does not validate
            return
        source = _source(loop.model)
        # a single model that is itself a ModuleDict or ModuleList is averaged whole, never narrowed
        self._several = isinstance(loop.model, (Mapping, list, tuple))
        sharded = [name for name, p in source.named_parameters() if type(p).__name__ == "DTensor"]
        if sharded:
            raise ValueError(f"ema: the model's parameters are sharded (Distributed(strategy='fsdp'): "
                             f"{sharded[0]!r} is a DTensor), and EMA keeps a whole copy it averages in place; "
                             f"use strategy='ddp' with EMA, or leave EMA out of a sharded run")
        if not self._evaluating:  # an evaluation steps no optimizer: its average is the checkpoint's
            self._watched = self._watch(loop)
            if self._several:
                source = _stepped_by(source, loop.optimizers, self._watched)
        self._build(source, decay)

    def _build(self, source: torch.nn.Module, decay: float) -> None:
        """The average of ``source``, a copy of it (its gradients left out)."""
        average = AveragedModel(source, multi_avg_fn=_ema_multi_avg_fn(decay), use_buffers=True)
        for p in average.parameters():
            p.grad = None  # deepcopy copies gradients the model may hold: the average needs none
        self._source, self.average = source, average
        # buffers holding infinities (a -inf mask): averaged they would be NaN (-inf with -inf); copied instead
        self._copied = [(a, b) for a, b in zip(average.module.buffers(), source.buffers(), strict=True)
                        if b.is_floating_point() and not bool(torch.isfinite(b).all())]

    @hookimpl
    def after_optimizer_step(self, loop: Run, name: str, optimizer: torch.optim.Optimizer) -> None:
        if name != self._watched:
            return
        self.steps += 1
        if self._updates.due(self.steps):
            average, source = self.average, self._source
            assert average is not None and source is not None  # made at fit_start
            average.update_parameters(source)
            self._copy_buffers()

    @hookimpl(wrapper=True)  # swaps in after every stage_start implementation: nested with other swappers
    def stage_start(self, loop: Run, stage: str) -> Generator[None, object, object]:
        result = yield
        if stage == "valid" and self.validate:
            if self._evaluating and self.average is not None and self.n_averaged == 0:
                why = ("it read no checkpoint" if loop.state.resumed_from is None else
                       "the checkpoint it read holds none, or was written before the average's first update")
                warnings.warn(f"ema: this evaluation has no average to validate ({why}): it validates the training "
                              f"weights", HookfitWarning, stacklevel=user_level())
            self._swap_in()
        return result

    @hookimpl(wrapper=True)  # swaps back before every stage_end implementation, in the reverse order of swapping in
    def stage_end(self, loop: Run, stage: str) -> Generator[None, object, object]:
        if stage == "valid":
            self._restore()
        return (yield)

    @hookimpl  # a stage cut short by an error fires no stage_end
    def exception(self, loop: Run, error: BaseException) -> None:
        self._restore()

    @hookimpl(wrapper=True)  # before every fit_end (a checkpoint's on a stop during validation)
    def fit_end(self, loop: Run) -> Generator[None, object, object]:
        self._restore()
        self._source = None
        return (yield)

    @hookimpl
    def save_state(self, loop: Run) -> dict[str, Any] | None:
        if self.average is None or (self._evaluating and self.n_averaged == 0):  # an evaluation's: none loaded
            return None
        return {
            "decay": self.decay,
            "n_averaged": int(self.average.n_averaged),
            "steps": self.steps,
            "state_dict": {k: v.detach().clone() for k, v in self.average.module.state_dict().items()},
        }

    @hookimpl
    def load_state(self, loop: Run, state: Mapping[str, Any]) -> None:
        if self.average is None:
            if self._evaluating and isinstance(state, Mapping) and "state_dict" in state:
                warnings.warn(f"ema: the checkpoint holds an exponential moving average of the weights "
                              f"({state.get('n_averaged', '?')} update(s)), and this evaluation validates the "
                              f"training weights, not the average; to validate the average, give "
                              f"Loop(plugins=[EMA(decay=...)]) (any decay: an evaluation updates nothing), and "
                              f"'hookfit export RUN model.pt --weights ema' writes it", HookfitWarning,
                              stacklevel=user_level())
            return
        try:
            weights, n_averaged, steps = state["state_dict"], int(state["n_averaged"]), int(state["steps"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"ema: the saved state is not an average this plugin saved "
                             f"({type(error).__name__}: {error})") from error
        weights = self._models_of(unwrap_state_dict(weights))  # ("_orig_mod." keys of before taken off)
        try:
            self.average.module.load_state_dict(weights)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"ema: the averaged weights in the checkpoint do not fit this run's model: "
                             f"{error}") from error
        self.average.n_averaged.fill_(n_averaged)
        self.steps = steps
        self._copy_buffers()  # (a checkpoint written before they were copied holds NaN in them)

    # -- set-up ---------------------------------------------------------------------------
    def _watch(self, loop: Run) -> str:
        """The name of the optimizer whose real steps update the average.

        An optimizer plugin manages the run's optimizers when it owns the backward pass (it
        implements ``backward``) and has put its own objects in ``loop.optimizers`` at
        ``configure`` (core/hooks.md, the optimizer role), whatever their type: a managed
        optimizer may well subclass ``torch.optim.Optimizer``. While ``loop.optimizers`` is still
        what ``Loop(optimizers=...)`` was given, nothing announces their steps."""
        optimizers = loop.optimizers
        unmanaged = ValueError(
            "ema: the average is updated after each optimizer step, which an optimizer plugin "
            "announces (after_optimizer_step), and no enabled plugin manages this run's "
            "optimizers: enable the optim plugin (and step through loop.optimizers)")
        if loop.hooks.backward is None:  # no plugin owns the backward pass
            raise unmanaged
        if optimizers is None:
            names: list[str] = []
        elif isinstance(optimizers, Mapping):
            names = [str(n) for n in optimizers]
        else:
            names = ["default"]
        if not names:
            raise ValueError("ema: this run has no optimizer, so nothing would update the average: "
                             "give Loop(optimizers=...)")
        if optimizers is loop.config.optimizers:  # the user's own: no plugin replaced them at configure
            raise unmanaged
        if self.optimizer is not None:
            if self.optimizer not in names:
                raise ValueError(f"ema: optimizer={self.optimizer!r} names no optimizer of this run; its "
                                 f"optimizers are {', '.join(map(repr, names))}")
            return self.optimizer
        if len(names) > 1:
            raise ValueError(f"ema: this run has {len(names)} optimizers ({', '.join(map(repr, names))}); "
                             f"name the one whose steps update the average: EMA(decay=..., optimizer=...)")
        return names[0]

    def _models_of(self, weights: Mapping[str, Any]) -> Mapping[str, Any]:
        """Saved averaged ``weights`` fitted to this run's several models: an average of some of them only
        (an evaluation, which knows no optimizer, averages every model until it reads which) makes the average
        the same models'; one of more models than this run averages gives those this run's average holds."""
        source, decay = self._source, self.decay
        if not self._several or not isinstance(source, (torch.nn.ModuleDict, torch.nn.ModuleList)) or decay is None:
            return weights
        mine = dict(source.named_children())
        saved = {key.split(".", 1)[0] for key in weights}
        if saved and saved < set(mine):
            self._build(torch.nn.ModuleDict({key: m for key, m in mine.items() if key in saved}), decay)
        elif saved > set(mine):
            weights = {key: value for key, value in weights.items() if key.split(".", 1)[0] in mine}
        return weights

    def _copy_buffers(self) -> None:
        """The buffers that hold infinities, copied from the model into the average (see ``fit_start``)."""
        with torch.no_grad():
            for averaged, source in self._copied:
                averaged.copy_(source)

    # -- validating with the average -----------------------------------------------------
    def _swap_in(self) -> None:
        """Copy the averaged weights and buffers into the model, keeping the training ones."""
        if self._kept is not None or self.average is None or self._source is None or self.n_averaged == 0:
            return
        targets = _tensors(self._source)
        averaged = _tensors(self.average.module)
        # validation runs under inference mode: the copies kept must be ordinary tensors
        with torch.inference_mode(False), torch.no_grad():
            self._kept = [(t, t.detach().clone()) for t in targets]
            for t, a in zip(targets, averaged, strict=True):
                t.copy_(a)

    def _restore(self) -> None:
        """Copy the training weights and buffers back, bit for bit (nothing if none are kept)."""
        kept, self._kept = self._kept, None
        if kept is None:
            return
        with torch.inference_mode(False), torch.no_grad():
            for t, value in kept:
                t.copy_(value)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What the average holds: the parameters, then the buffers (as ``use_buffers=True``)."""
    return list(itertools.chain(module.parameters(), module.buffers()))


def _unwrap(model: Any, where: str) -> torch.nn.Module:
    """The user's module (the one inside a ``DistributedDataParallel``, ``DataParallel`` or
    ``torch.compile`` wrapper: :func:`~hookfit.plugins.support.unwrap_model`)."""
    if isinstance(model, torch.nn.Module):
        return unwrap_model(model)
    raise ValueError(f"ema: {where} is a {type(model).__name__}, not a torch.nn.Module: the average is "
                     f"of modules (Loop(model=...) takes a module, or a dict or list of them)")


def _stepped_by(source: torch.nn.Module, optimizers: Any, name: str) -> torch.nn.Module:
    """Of several models (a ``ModuleDict`` or ``ModuleList`` of them), those that optimizer ``name`` steps
    a parameter of, as a ``ModuleDict`` keyed as in ``source`` (a list's by position); ``source`` itself when
    that is every model, or when the optimizer says nothing of its parameters."""
    optimizer = optimizers[name] if isinstance(optimizers, Mapping) else optimizers
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(source, (torch.nn.ModuleDict, torch.nn.ModuleList)) or not groups:
        return source
    stepped = {id(p) for group in groups for p in group.get("params", ())}
    models = dict(source.named_children())
    kept = {key: m for key, m in models.items() if any(id(p) in stepped for p in m.parameters())}
    return torch.nn.ModuleDict(kept) if kept and len(kept) < len(models) else source


def _source(model: Any) -> torch.nn.Module:
    """The module to average: ``loop.model`` itself, or a container of the modules of a dict
    or list of models (sharing their parameters)."""
    if model is None:
        raise ValueError("ema: this run has no model to average: give Loop(model=...)")
    if isinstance(model, Mapping):
        for key in model:
            if not isinstance(key, str) or not key or "." in key:
                raise ValueError(f"ema: the models of Loop(model={{...}}) are averaged as a ModuleDict, whose "
                                 f"keys are non-empty strings without '.'; got the key {key!r}")
        return torch.nn.ModuleDict({k: _unwrap(v, f"model[{k!r}]") for k, v in model.items()})
    if isinstance(model, (list, tuple)):
        return torch.nn.ModuleList([_unwrap(v, f"model[{i}]") for i, v in enumerate(model)])
    return _unwrap(model, "Loop(model=...)")
