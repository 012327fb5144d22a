"""Reproducible runs: ``Loop(seed=...)`` and ``Loop(deterministic=True)``.

:func:`seed_everything` seeds every random number generator a training step draws from:
Python's ``random``, NumPy's global generator (when NumPy is installed) and torch's on every
device (``torch.manual_seed`` seeds the CUDA generators too). Data order follows: a
``DataLoader`` with ``shuffle=True`` and no generator of its own draws its order (and its
workers' seeds) from torch's generator, and ``hookfit.data.Batches`` and
``DistributedSampler`` shuffle from seeds of their own. A loader's own generator
(``DataLoader(generator=g)``, a sampler's) is the script's, and the seed leaves it as it is (as
Lightning's ``seed_everything`` does): :func:`seed_run` names one that goes on from where an
earlier run in the process left it, as where a notebook cell runs the same loader again. The
model's initial weights are drawn before the ``Loop`` exists: seed before building it
(``hookfit.seed_everything(0)``) for those too.

:class:`Deterministic` switches on PyTorch's deterministic algorithms for the time of a run
(an operation without a deterministic implementation then raises, naming itself), with
cuDNN's autotuner off and, for cuBLAS on GPUs, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; it puts
every setting back as it was when the run ends.
"""

from __future__ import annotations

import contextlib
import operator
import os
import random
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["Deterministic", "as_int", "check_seed", "seed_everything", "seed_run"]

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
SEED_LIMIT = 2**32  # NumPy's global generator takes seeds below this


def check_seed(seed: Any) -> int | None:
    """``seed`` as a plain ``int`` (or ``None``); a ``ValueError`` unless it is an integer in ``[0, 2**32)``."""
    if seed is None:
        return None
    number = as_int(seed)
    if number is None or not 0 <= number < SEED_LIMIT:
        raise ValueError(f"seed must be an integer from 0 to 2**32 - 1 (or None), got {seed!r}")
    return number


def as_int(value: Any) -> int | None:
    """``value`` as a plain ``int`` where it is an integer (NumPy's too: ``__index__``), else ``None``
    (a ``bool``, a float, a float tensor or array, whose ``__index__`` refuses; a ``bool`` tensor, whose does not)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__") or getattr(value, "dtype", None) is torch.bool:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's (every device)."""
    if (checked := check_seed(seed)) is None:
        raise ValueError("seed_everything needs an integer seed, got None")
    seed = checked
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


_LEFT: weakref.WeakKeyDictionary[torch.Generator, torch.Tensor] = weakref.WeakKeyDictionary()
"""Each loader's own generator that a run in this process drew from, with its state as that run ended."""


@contextlib.contextmanager
def seed_run(seed: int | None, train_data: Any, val_data: Any) -> Iterator[str | None]:
    """For the time of a run: seed everything with ``seed`` (nothing without one), and give, as a warning's
    text, which ``DataLoader`` among ``train_data`` and ``val_data`` (one, or a mapping of named sets) has a
    generator of its own (:func:`hookfit.data.generators`) that goes on from where an earlier run in this
    process left it: its state is the one that run ended with, so nobody seeded or set it since, and the seed
    does not reach it. ``None`` where there is none: a generator the script drew from before any run
    (``random_split``'s, a look at one batch) gives the same order from one fresh script to the next. As the
    run ends, each of these generators it drew from is kept with its state then, weakly (a collected
    generator leaves nothing)."""
    from hookfit.data import generators  # (hookfit.data reads this module's as_int)

    named = [("train_data", train_data)] + ([(f"val_data[{key!r}]", data) for key, data in val_data.items()]
                                            if isinstance(val_data, Mapping) else [("val_data", val_data)])
    begun = [(f"{name}.{at}", g, g.get_state()) for name, data in named for at, g in generators(data).items()]
    left = [name for name, g, state in begun if (end := _LEFT.get(g)) is not None and torch.equal(state, end)]
    if seed is not None:
        seed_everything(seed)
    try:
        yield None if seed is None or not left else (
            f"seed={seed} does not reseed a DataLoader's own generator, and {', '.join(left)} "
            f"{'goes' if len(left) == 1 else 'go'} on from where an earlier run in this process left "
            f"{'it' if len(left) == 1 else 'them'} (a notebook cell run again, a sweep reusing the loader), so this "
            f"run's data order is not a fresh script's: seed it before each fit(), g.manual_seed(N), or give the "
            f"loader a new torch.Generator().manual_seed(N) each run")
    finally:
        for _, g, state in begun:
            if not torch.equal(now := g.get_state(), state):
                _LEFT[g] = now


class Deterministic:
    """Deterministic algorithms on entry, every setting as it was on exit (see the module)."""

    def __enter__(self) -> Deterministic:
        self._saved = (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled(),
                       torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                       os.environ.get(CUBLAS))
        if self._saved[4] is None:
            os.environ[CUBLAS] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        return self

    def __exit__(self, *exc: Any) -> None:
        enabled, warn_only, benchmark, cudnn_deterministic, cublas = self._saved
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        torch.backends.cudnn.deterministic = cudnn_deterministic
        if cublas is None:
            os.environ.pop(CUBLAS, None)
