"""A small plugin: log the gradient norm before every optimizer step.

Use it with ``Loop(..., plugins=[GradNorm()])``, or register it in the ``hookfit`` entry-point
group of your own package to have it in every run.

On an accelerator, reading a value on the host (``.item()``, ``float()``) waits for the device to
finish: once per step, that stalls training. The norms are therefore kept as tensors where the
gradients are and read once at the end of each training stage (or when ``norms`` is read).
"""

import torch

import hookfit


class GradNorm:
    """Collects the total gradient norm each optimizer steps with (after clipping), one float a
    step; an optimizer none of whose parameters got a gradient has no norm and is left out."""

    name = "grad_norm"
    observer = True  # it only watches: an error of its own switches it off, never fails the run

    def __init__(self) -> None:
        self._read: list[float] = []
        self._pending: list[torch.Tensor] = []  # this stage's norms, on the gradients' device

    @property
    def norms(self) -> list[float]:
        """Every norm so far, in step order."""
        self.read()
        return self._read

    def read(self) -> None:
        """Read the pending norms from the device: one host read for all of them."""
        if self._pending:
            self._read += torch.stack(self._pending).tolist()
            self._pending.clear()

    @hookfit.hookimpl
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            self._pending.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    @hookfit.hookimpl
    def stage_end(self, stage: str) -> None:
        if stage == "train":  # after optim's tryfirst stage_end, which may step a partial window
            self.read()
