"""``loop.optimizers.toggle(name)`` and the note it leaves on a backward pass it broke.

Inside ``with loop.optimizers.toggle("D"):`` the parameters of every other optimizer are
frozen (``requires_grad=False``), so that a backward pass there trains ``"D"``'s alone. A
tensor computed there from frozen parameters (the generator's forward inside the
discriminator's toggle) records no graph through them, and a loss computed from it later with
nothing else requiring a gradient makes torch raise ``... does not require grad and does not
have a grad_fn``: :func:`note_toggles` adds a note naming each toggle of the batch, the
parameters it froze, and what to write instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hookfit.plugins.support import unwrap_model

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.managed import Optimizers
    from hookfit.run import Run

__all__ = ["Toggled", "note_toggles", "stamp"]

NO_GRAD = "does not require grad"
"""In torch's error for a backward pass through nothing that requires a gradient."""


class Toggled(NamedTuple):
    """A ``toggle(name)`` entered during a batch: the parameters it froze, by optimizer."""

    name: str
    frozen: Mapping[str, list[torch.Tensor]]
    at: Any  # the batch it was entered in (stamp)


def stamp(loop: Run | None) -> Any:
    """Which batch of the run is running: toggles are remembered for the batch they came in."""
    if loop is None:
        return None
    state = loop.state
    return state.epoch, state.stage, state.batch_idx, state.step


def note_toggles(optimizers: Optimizers | None, loop: Run, error: RuntimeError) -> None:
    """Add a note to ``error``, torch's error for a backward pass through nothing that requires
    a gradient, when a ``toggle`` of this batch froze parameters: which, and why."""
    if optimizers is None or NO_GRAD not in str(error):
        return
    now = stamp(loop)
    toggled = [t for t in optimizers.toggled if t.at == now and t.frozen]
    if not toggled:
        return
    names = parameter_names(loop.model)
    lines = []
    for t in toggled:
        frozen = "; ".join(f"the {len(params)} parameter tensor(s) of optimizer {other!r} ({_few(params, names)})"
                           for other, params in t.frozen.items())
        lines.append(f"  loop.optimizers.toggle({t.name!r}) froze {frozen}")
    error.add_note(
        "optim: this batch ran loop.optimizers.toggle(...), which freezes the parameters of the other "
        "optimizers (requires_grad=False) for its `with` block, so that a backward pass there trains the "
        "toggled optimizer's alone:\n" + "\n".join(lines) + "\n"
        "A tensor computed inside such a block (a generator's output inside the discriminator's toggle) "
        "records no gradient through the parameters it froze: a loss computed from it later trains none of "
        "them and, with nothing else requiring a gradient, has no grad_fn, as here. Compute that tensor "
        "outside the block (and detach it where the toggled optimizer's model reads it: D(fake.detach())), "
        "or inside the toggle of the optimizer its loss trains.")


def parameter_names(model: Any) -> dict[int, str]:
    """``id(parameter)`` -> its name in the run's model (``"g.0.weight"`` in a dict of models)."""
    out: dict[int, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, torch.nn.Module):
            for name, parameter in unwrap_model(node).named_parameters():
                out.setdefault(id(parameter), prefix + name)
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                walk(value, f"{prefix}{index}.")

    walk(model, "")
    return out


def _few(params: list[torch.Tensor], names: Mapping[int, str], shown: int = 4) -> str:
    """A few parameters by name (by shape where the model does not hold them)."""
    parts = [names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in params[:shown]]
    if len(params) > shown:
        parts.append(f"and {len(params) - shown} more")
    return ", ".join(parts)
