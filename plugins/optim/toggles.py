"""``loop.optimizers.toggle(name)``'s record, and the note on a backward pass it broke (README.md, "Toggles")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

import torch

from hookfit.plugins.support import parameter_names

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.plugins.optim.managed import Optimizers
    from hookfit.run import Run

NO_GRAD = "does not require grad"  # in torch's error for a backward pass through nothing that requires one


class Toggled(NamedTuple):
    """A ``toggle(name)`` entered during a batch: the parameters it froze, by optimizer."""

    name: str
    frozen: Mapping[str, list[torch.Tensor]]
    at: Any  # the batch it was entered in (stamp)


def stamp(loop: Run | None) -> Any:
    """Which batch of the run is running: toggles are remembered for the batch they came in."""
    return None if loop is None else (loop.state.epoch, loop.state.stage, loop.state.batch_idx, loop.state.step)


def note_toggles(optimizers: Optimizers | None, loop: Run, error: RuntimeError) -> None:
    """Add a note naming this batch's toggles to torch's error for a backward pass through nothing to train."""
    toggled = [t for t in (optimizers.toggled if optimizers is not None and NO_GRAD in str(error) else ())
               if t.at == stamp(loop) and t.frozen]  # this batch's, if torch's error is of a pass through nothing
    if not toggled:
        return
    lines = "".join(f"  loop.optimizers.toggle({t.name!r}) froze " + "; ".join(
        f"the {len(params)} parameter tensor(s) of optimizer {other!r} ({_few(params, parameter_names(loop.model))})"
        for other, params in t.frozen.items()) + "\n" for t in toggled)
    error.add_note(
        "optim: this batch ran loop.optimizers.toggle(...), which freezes the parameters of the other "
        "optimizers (requires_grad=False) for its `with` block, so that a backward pass there trains the "
        "toggled optimizer's alone:\n" + lines +
        "A tensor computed inside such a block (a generator's output inside the discriminator's toggle) "
        "records no gradient through the parameters it froze: a loss computed from it later trains none of "
        "them and, with nothing else requiring a gradient, has no grad_fn, as here. Compute that tensor "
        "outside the block (and detach it where the toggled optimizer's model reads it: D(fake.detach())), "
        "or inside the toggle of the optimizer its loss trains.")


def _few(params: list[torch.Tensor], names: Mapping[int, str], shown: int = 4) -> str:
    """A few parameters by name (by shape where the model does not hold them)."""
    parts = [names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in params[:shown]]
    return ", ".join(parts + ([f"and {len(params) - shown} more"] if len(params) > shown else []))
