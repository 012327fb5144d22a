"""What the metrics plugin says of a step output's value it leaves out: a mapping of numbers inside the output
(Lightning's ``{"log": {...}}``), which no metric aggregates."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hookfit.plugins.metrics.aggregate import Tensor, as_real, is_metric, numpy_kind
from hookfit.stopping import qualname


def nested(key: str, value: object, step: object, val_set: str | None = None) -> str | None:
    """What to say of ``value``, returned under ``key`` by ``step``, when it is a mapping holding numbers or metric
    objects (Lightning's ``{"loss": loss, "log": {"acc": acc}}``), which no metric aggregates: the plugin takes the
    step output's own values, not those of a mapping inside it. A number is a real one, not a ``bool``, or a
    0-dimensional real tensor: a one-element vector or matrix (a batch of one's per-sample value) is not. ``None`` for
    any other value the plugin leaves out (a vector, text, a mapping of vectors: what another plugin reads in
    ``batch_end``). The advice names string keys: a mapping keyed by numbers (a class's index) is advised as
    ``'<key>/<index>'``, ``key`` without the validation set's prefix (``val_set``). Reads no tensor's value."""
    if not isinstance(value, Mapping):
        return None
    held = [name for name, v in value.items() if is_metric(v) or (
        (v.dim() == 0 and not v.is_complex() and v.dtype is not torch.bool) if isinstance(v, Tensor)
        else as_real(v) is not None and not isinstance(v, bool) and numpy_kind(v) != "b")]
    if not held:
        return None
    own = key[len(val_set) + 1:] if val_set is not None and key.startswith(f"{val_set}/") else key
    first = repr(held[0] if isinstance(held[0], str) else f"{own}/{held[0]}")
    return (f"metrics: step function {qualname(step)!r} returned under {key!r} a dict of "
            f"{', '.join(map(repr, held))}, which no metric aggregates: the metrics plugin takes the values of the "
            f"step's output itself, not of a dict inside it (Lightning's {{'log': {{...}}}}), and drops it in every "
            f"batch; return them at the top level, {{'loss': loss, {first}: ...}} (README.md, 'A first script')")
