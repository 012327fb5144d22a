"""A ten-line plugin: log the gradient norm before every optimizer step.

Use it with ``Loop(..., plugins=[GradNorm()])``, or register it in the ``hookfit`` entry-point
group of your own package to have it in every run.
"""

import torch

import hookfit


class GradNorm:
    """Collects the total gradient norm each optimizer steps with (after clipping)."""

    name = "grad_norm"

    def __init__(self) -> None:
        self.norms: list[float] = []

    @hookfit.hookimpl
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
