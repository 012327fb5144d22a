"""Where a run is, as the run itself keeps it: :class:`Position`, the random state that goes
with it, and :class:`Cursor`, which the loop moves as it goes.

A run serialises its own position (``loop.state_dict()``, as Ignite's ``Engine.state_dict()``
does) and takes it back (``loop.load_state_dict(saved)``); a checkpoint plugin only stores
what it was given. What the run's state dict holds:

* ``"loop"``: the :class:`Position` as a mapping (``epoch``, ``step``, ``resume_batch``,
  ``resume_stage`` and, only when true, ``val_due``);
* ``"rng"``: the random state (Python, NumPy when it is installed, torch, CUDA when it is in
  use) that belongs to that position: the state *now*, except inside a validation (an epoch's
  own: until the epoch ends), which a resumed run runs again from its start, where it is the
  state as that validation began; and, under ``"data"``, the state now of each torch generator
  of the training data's own (:func:`hookfit.data.generators`: ``DataLoader(generator=...)``, a
  sampler's generator), by name, and of the validation data's (:func:`valid_generators`, as a running validation began);
* ``"data"``: the ``state_dict()`` of training and validation data that has one (and
  ``load_state_dict``): torchdata's ``StatefulDataLoader``, :class:`hookfit.data.Batches`
  (inside a validation, the validation data's state as it began);
* ``"carry"``, inside a training stage: what the step carries across its batches
  (``loop.carry``, see :attr:`hookfit.run.Run.carry`), its tensors detached;
* ``"data_rng"``, inside a training stage: the random state (Python's, torch's and, under
  ``"data"``, the training data's own generators') as that stage made its data iterator. A
  ``DataLoader`` draws its base seed and its shuffle from its own generator when it has one,
  else from the global one, when it is iterated: a resumed run makes its iterator from this
  state, drops the batches already done, then goes on with ``"rng"``, so the rest of the
  epoch has the same batches, in the same order, and the same random stream (dropout, noise)
  as the run it continues. A run resumed at an epoch's start makes that epoch's iterator from
  ``"rng"``, which holds the loader's generators as the epoch before left them.
* ``"persistent_iterators"``, only when there are any: the run's data (``"train"``,
  ``"valid"``, ``"valid/<name>"``) that is a ``DataLoader`` with persistent workers (and no
  state of its own) and had made its iterator at the position (the training data as the open
  training stage made its iterator, the validation data as a running validation began): a
  resumed run makes theirs first, with the random state kept, so that the iterator it resumes
  with is reset, drawing no workers' base seed, as the run it continues had it (see
  :mod:`hookfit.persistent`). A state without it (an older one) makes every iterator anew.
* ``"workers"``: each loader's ``num_workers`` by the same names; a resumed run with others warns.

The state dict is JSON-safe by construction where it is the core's: string keys, ``int``,
``float``, ``bool``, ``str``, ``None``, lists (never tuples) and dicts of them, and tensors
(uint8 random states, NumPy's keys as int64). A store that writes tensors apart (safetensors)
and the rest as JSON gives back what it was given. What the data's own ``state_dict()`` and the
step's ``loop.carry`` hold is theirs: a tuple there comes back from a JSON store as a list.

When the iterator is made: a training stage makes its data iterator (``iter(train_data)``,
or ``iter_from(batch)``) after ``epoch_start`` and ``stage_start``, before the stage's first
``batch_start``; the training data's ``set_epoch(epoch)`` is called (:func:`hookfit.data.tell_epoch`;
never the validation data's) before ``epoch_start``; a resume (``resume``, ``load_state``) comes before all of them. So a plugin
may keep the data's order itself, restoring what it saved at ``resume``; the way to tell the
core the order is kept is for the data to carry its own state (``state_dict()`` and
``load_state_dict()``, as torchdata's ``StatefulDataLoader`` does): the run saves it under
``"data"``, and data whose state was restored is trusted to continue where it was, with no
"cannot be rebuilt" warning.

Which batches the core skips at a resume: data with ``iter_from(start)`` starts there
(:class:`hookfit.data.Batches`); data whose own state was restored (it has ``load_state_dict``
and its state was saved) is trusted to continue where it was, and nothing is skipped again;
any other iterable is iterated and its first ``resume_batch`` batches dropped.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from hookfit.data import generators
from hookfit.persistent import made, made_iterators, named

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.state import State

__all__ = ["Cursor", "Position", "check_position", "check_rng", "generator_states", "iterator_rng_state", "rng_state",
           "set_rng_state", "valid_generators", "weights_of"]

Stage = Literal["train", "valid"]


@dataclass(frozen=True)
class Position:
    """Where a resumed run continues.

    * ``epoch``: the epoch it continues in, from 0;
    * ``step``: training batches done in the whole run (the global step);
    * ``batch``: training batches of ``epoch`` done (the loop skips them);
    * ``stage``: ``"train"`` (go on training at ``batch``), or ``"valid"``: the epoch's
      training stage is complete, ``stage_end`` included, and what is left of the epoch is
      its validation and ``epoch_end``;
    * ``val_due``: inside the training stage, a validation due at ``step``
      (``Loop(val_every_n_steps=N)``) has not run to its end: it runs first.
    """

    epoch: int = 0
    step: int = 0
    batch: int = 0
    stage: Stage = "train"
    val_due: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The position as the run's state dict keeps it (``val_due`` only when true)."""
        out: dict[str, Any] = {"epoch": self.epoch, "step": self.step, "resume_batch": self.batch,
                               "resume_stage": self.stage}
        if self.val_due:
            out["val_due"] = True
        return out

    def key(self) -> tuple[int, int, bool, bool]:
        """A sort key: of two positions of one run, the later one has the greater key. The
        global step first; at one step, the epoch (an epoch's end, at the start of the next
        one, after its last batch), then a complete training stage (``"valid"``) after an open
        one, then the step with its due validation run (``val_due`` false) after it was due."""
        return (self.step, self.epoch, self.stage == "valid", not self.val_due)

    @classmethod
    def from_dict(cls, saved: Any) -> Position:
        """The position a state dict's ``"loop"`` entry describes, checked by
        :func:`check_position`."""
        check_position(saved)
        return cls(saved["epoch"], saved["step"], saved["resume_batch"], saved["resume_stage"],
                   bool(saved.get("val_due", False)))


class Cursor:
    """The loop's record of its position, moved at the loop's own boundaries: where the
    training stage of the epoch began, whether it is open, where the run stands between stages,
    and the random state as a running validation began. :meth:`position` says where a state
    dict taken now resumes."""

    __slots__ = ("state", "training", "step0", "batch0", "done", "valid_rng", "valid_data", "iter_rng",
                 "iter_made", "valid_made", "made_before", "start", "restored", "held", "carry", "resumed_carry")

    def __init__(self, state: State) -> None:
        self.state = state
        self.training = False  # a training stage is open (a validation may run inside it)
        self.step0 = self.batch0 = 0  # the global step and first batch as the training stage began
        self.done: tuple[int, int, Stage] = (0, 0, "train")  # the position outside a training stage
        self.valid_rng: dict[str, Any] | None = None
        self.valid_data: Any = None  # the validation data's own state as the running validation began
        self.iter_rng: dict[str, Any] | None = None  # the random state as the training stage made its iterator
        self.iter_made = False  # that iterator was a persistent one reset (hookfit.persistent.made)
        self.valid_made: list[str] | None = None  # the validation data so made as the running validation began
        self.made_before: frozenset[str] = frozenset()  # the loaded state's "persistent_iterators"
        self.start: Position | None = None  # where a loaded state dict put the run, until it starts there
        self.restored: set[str] = set()  # the data ("train", "valid") that restored its own state
        self.held: frozenset[str] = frozenset()  # the training data's generators a loaded state gave back
        self.carry: dict[str, Any] = {}  # the training stage's loop.carry (saved while the stage is open)
        self.resumed_carry: dict[str, Any] | None = None  # a loaded state's carry, for the stage it resumes

    def epoch_begins(self, epoch: int, batch: int = 0, stage: Stage = "train") -> None:
        self.done = (epoch, batch, stage)

    def train_begins(self, batch: int) -> dict[str, Any]:
        """The training stage begins at ``batch``: returns its ``loop.carry``, empty unless a
        loaded state resumes the stage with one."""
        self.training, self.step0, self.batch0 = True, self.state.step, batch
        carry, self.resumed_carry = self.resumed_carry, None
        self.carry = carry if carry is not None else {}
        return self.carry

    def train_ends(self) -> None:
        self.done = (self.state.epoch, self.trained(), "valid")
        self.training = False

    def epoch_ends(self) -> None:
        self.done = (self.state.epoch + 1, 0, "train")
        self.valid_rng = self.valid_data = self.valid_made = None

    def iterator_begins(self, data: Any) -> None:
        """The training stage makes its iterator over ``data`` now, from its start."""
        self.iter_rng, self.iter_made = iterator_rng_state(data), made(data)

    def valid_begins(self, data: Any) -> None:
        if self.valid_rng is None:
            self.valid_rng = rng_state()
            if began := _states(valid_generators(data)):  # as the validation draws them: a resume runs it again
                self.valid_rng["data"] = began
            self.valid_data = data.state_dict() if hasattr(data, "state_dict") and hasattr(data, "load_state_dict") else None
            self.valid_made = made_iterators(None, data)

    def valid_ends(self) -> None:
        """Inside a training stage the position moves past the validation; the epoch's own stays the
        position's (``"valid"``, run again from its start, as it began) until :meth:`epoch_ends`."""
        if self.training:
            self.valid_rng = self.valid_data = self.valid_made = None

    def persistent_iterators(self, train_data: Any, val_data: Any) -> list[str]:
        """The run's data whose persistent iterator goes with :meth:`position` (the state's
        ``"persistent_iterators"``): as the open training stage made its iterator, as a running
        validation began, else now."""
        train = self.iter_made if self.training else made(train_data)
        valid = self.valid_made if self.valid_made is not None else made_iterators(None, val_data)
        return (["train"] if train else []) + valid

    def trained(self) -> int:
        """Training batches of the running epoch whose step completed: the stage's first batch
        plus the steps counted since it began (a batch whose step raised is not counted)."""
        return self.batch0 + self.state.step - self.step0

    def position(self) -> Position:
        state = self.state
        if self.training:
            return Position(state.epoch, state.step, self.trained(), "train", bool(state.val_due))
        epoch, batch, stage = self.done
        return Position(epoch, state.step, batch, stage)

    def rng(self, data: Any = None, val_data: Any = None) -> dict[str, Any]:
        """The random state that goes with :meth:`position`, with the state now of the
        generators of ``data``'s own (the training data) and of ``val_data``'s
        (:func:`valid_generators`), those as the running validation began."""
        if self.valid_rng is None:
            state, own = rng_state(), {**generator_states(data), **_states(valid_generators(val_data))}
        else:
            state, own = self.valid_rng, {**(self.valid_rng.get("data") or {}), **generator_states(data)}
        return {**state, "data": own} if own else state


# -- random state -----------------------------------------------------------------------------


def generator_states(data: Any) -> dict[str, Any]:
    """The states of ``data``'s own torch generators (:func:`hookfit.data.generators`), by
    name; empty without any."""
    return _states(generators(data))


def valid_generators(val_data: Any) -> dict[str, Any]:
    """The validation data's own generators (:func:`hookfit.data.generators`), named by the data's
    name in the run and theirs (``"valid:generator"``, ``"valid/noisy:sampler.generator"``): a
    random state keeps them under ``"data"`` beside the training data's; a resume restores them."""
    return {f"{where}:{name}": generator for where, data in named(None, val_data).items()
            for name, generator in generators(data).items()}


def _states(found: Mapping[str, Any]) -> dict[str, Any]:
    return {name: generator.get_state() for name, generator in found.items()}


def rng_state(data: Any = None) -> dict[str, Any]:
    """Every random generator a training script draws from, as plain data and tensors (lists,
    never tuples): Python's, NumPy's, torch's, CUDA's in use and, under ``"data"``, those of
    ``data``'s own (:func:`generator_states`) when it has any."""
    import torch

    version, keys, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(keys), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:
        pass
    else:  # the legacy tuple: the global RandomState's generator is MT19937
        legacy = cast("tuple[str, Any, int, int, float]", numpy.random.get_state())
        name, keys_np, pos, has_gauss, cached = legacy
        out["numpy"] = [name, torch.from_numpy(keys_np.astype("int64")), pos, has_gauss, cached]
    if _cuda_in_use():
        out["cuda"] = torch.cuda.get_rng_state_all()
    if own := generator_states(data):
        out["data"] = own
    return out


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]  # unannotated in torch


def iterator_rng_state(data: Any = None) -> dict[str, Any]:
    """The generators a data iterator draws from as it is made, cheaply (once per training
    stage): Python's and torch's (and CUDA's in use) and ``data``'s own, not NumPy's, which a
    ``DataLoader`` does not draw from (its state costs tens of microseconds to read). A valid
    :func:`rng_state` without its ``"numpy"`` entry."""
    import torch

    version, keys, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(keys), gauss], "torch": torch.get_rng_state()}
    if _cuda_in_use():
        out["cuda"] = torch.cuda.get_rng_state_all()
    if own := generator_states(data):
        out["data"] = own
    return out


def set_rng_state(state: Mapping[str, Any], data: Any = None, val_data: Any = None) -> frozenset[str]:
    """Restore what :func:`rng_state` returned (CUDA only on as many devices as it had), and
    the states of ``data``'s own generators that it holds, and of ``val_data``'s
    (:func:`valid_generators`); returns the names of ``data``'s."""
    import torch

    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        name, keys_np, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys_np.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("data") or {}
    own = {name: generator for name, generator in generators(data).items() if name in saved}
    for name, generator in {**own, **valid_generators(val_data)}.items():
        if name in saved:
            generator.set_state(saved[name])
    return frozenset(own)


# -- checks of a saved state ------------------------------------------------------------------


def _natural(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


def check_position(position: Any, train_data: Any = None) -> None:
    """A ``ValueError`` naming the entry when ``position`` (a state dict's ``"loop"``) is not
    a possible position, or one beyond ``train_data`` (when that has a length): the data a run
    trains on from there, ``None`` for an evaluation (``Loop.validate()``), which trains nothing."""
    if not isinstance(position, Mapping):
        raise ValueError(f"'loop' (the position) is a {type(position).__name__}, not a mapping")
    for key in ("epoch", "step", "resume_batch"):
        if key not in position:
            raise ValueError(f"the position ('loop') lacks {key!r}")
        if not _natural(position[key]):
            raise ValueError(f"impossible position: loop[{key!r}] is {position[key]!r}, not a count "
                             f"(an integer >= 0)")
    stage = position.get("resume_stage")
    if stage not in ("train", "valid"):
        raise ValueError(f"impossible position: loop['resume_stage'] is {stage!r}, not 'train' or 'valid'")
    if not isinstance(position.get("val_due", False), bool):
        raise ValueError(f"impossible position: loop['val_due'] is {position['val_due']!r}, not True or False")
    try:
        length = len(train_data)
    except TypeError:
        return
    if position["resume_batch"] > length:
        raise ValueError(f"impossible position: {position['resume_batch']} training batches done in epoch "
                         f"{position['epoch'] + 1}, and this run's training data has {length}")


def check_rng(rng: Any) -> None:
    """A ``ValueError`` naming the entry when ``rng`` is not what :func:`rng_state` returns
    (on this machine: Python's key count, torch's state size)."""
    import torch

    def bad(what: str, why: str) -> ValueError:
        return ValueError(f"bad RNG state: rng[{what!r}] {why}")

    if not isinstance(rng, Mapping):
        raise ValueError(f"'rng' is a {type(rng).__name__}, not a mapping")
    for key in ("python", "torch"):
        if key not in rng:
            raise bad(key, "is missing")
    py = rng["python"]
    keys_len = len(random.getstate()[1])
    if not isinstance(py, (list, tuple)) or len(py) != 3:
        raise bad("python", f"is a {type(py).__name__}, not [version, keys, gauss]")
    version, keys, gauss = py
    if not isinstance(version, int) or not isinstance(keys, (list, tuple)) or len(keys) != keys_len or not all(
            isinstance(k, int) and not isinstance(k, bool) for k in keys) or not (
            gauss is None or isinstance(gauss, float)):
        size = len(keys) if isinstance(keys, (list, tuple)) else type(keys).__name__
        raise bad("python", f"is not Python's random state (keys: {size}, expected {keys_len} integers)")
    here = torch.get_rng_state()
    state = rng["torch"]
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != here.shape:
        what = (f"a {state.dtype} tensor of shape {tuple(state.shape)}" if isinstance(state, torch.Tensor)
                else f"a {type(state).__name__}")
        raise bad("torch", f"is {what}, expected a uint8 tensor of shape {tuple(here.shape)}")
    if "numpy" in rng:
        np_state = rng["numpy"]
        if not isinstance(np_state, (list, tuple)) or len(np_state) != 5:
            raise bad("numpy", f"is a {type(np_state).__name__}, not [name, keys, pos, has_gauss, cached]")
        name, np_keys, pos, has_gauss, cached = np_state
        if name != "MT19937" or not isinstance(np_keys, torch.Tensor) or np_keys.shape != (624,) or (
                np_keys.is_floating_point()) or not _natural(pos) or pos > 624 or not isinstance(has_gauss, int) or (
                not isinstance(cached, (int, float)) or not math.isfinite(float(cached))):
            raise bad("numpy", "is not NumPy's MT19937 state (name, 624 keys, position, gauss)")
    if "data" in rng:
        own = rng["data"]
        if not isinstance(own, Mapping) or not all(
                isinstance(k, str) and isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
                for k, t in own.items()):
            raise bad("data", "is not a mapping of names to generator states (uint8 tensors)")
    if "cuda" in rng:
        cuda = rng["cuda"]
        if not isinstance(cuda, (list, tuple)) or not all(
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda):
            raise bad("cuda", "is not a list of uint8 tensors (one per device)")


def weights_of(at: Position) -> Position:
    """Where the weights of a checkpoint saved at ``at`` were made, for ``Loop.validate()``:
    a checkpoint at the start of epoch ``e > 0`` (an epoch's end, after ``after_epoch``) holds
    the weights of epoch ``e - 1``, its training complete (batch 0: an evaluation reads no training
    data, so it does not know how many), labelled so as its file name is (``epoch0001-...``: the
    first epoch's end), not as the epoch a training run would continue in. Else ``at`` itself."""
    if at.stage != "train" or at.batch or at.val_due or at.epoch == 0:
        return at
    return Position(at.epoch - 1, at.step, 0, "valid")
