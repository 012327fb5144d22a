"""A small plugin: the gradient norm of every optimizer step, published with the metrics.

Use it with ``Loop(..., plugins=[GradNorm()])``, or register it in the ``hookfit`` entry-point
group of your own package to have it in every run.

It answers the metrics plugin's ``metrics_values`` event with the latest step's norm, as
``grad_norm`` (``grad_norm_<name>`` for each optimizer of several), so the console, the dashboard,
the csv and the other loggers, ``metrics.jsonl`` and early stopping show it like any metric of the
training stage: a row of an epoch has its last step's norm.

On an accelerator, reading a value on the host (``.item()``, ``float()``) waits for the device to
finish: once per step, that stalls training. The norms are therefore kept as tensors where the
gradients are: the metrics plugin reads the latest at each of its publications (a few a second
at most, never per step), and every norm is read at once at the end of each training stage (or
when ``norms`` is read).
"""

import torch

import hookfit


class GradNorm:
    """Collects the total gradient norm each optimizer steps with (after clipping), one float a
    step; an optimizer none of whose parameters got a gradient has no norm and is left out. A
    sparse gradient counts by its values, duplicates summed, as ``clip_grad_norm_`` would need them."""

    name = "grad_norm"
    observer = True  # it only watches: an error of its own switches it off, never fails the run

    def __init__(self) -> None:
        self._read: list[float] = []
        self._pending: list[torch.Tensor] = []  # this stage's norms, on the gradients' device
        self._latest: dict[str, torch.Tensor] = {}  # each optimizer's latest norm in this stage, published

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
    def stage_start(self, stage: str) -> None:
        if stage == "train":  # no norm of an earlier epoch is published as this one's
            self._latest.clear()

    @hookfit.hookimpl
    def before_optimizer_step(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # a sparse gradient (an nn.Embedding(sparse=True) under SparseAdam): its stored values, coalesced
        grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            self._pending.append(norm)
            self._latest[name] = norm

    @hookfit.hookimpl
    def metrics_values(self, stage: str) -> dict[str, torch.Tensor] | None:
        """The latest norms, as tensors: the metrics plugin reads them at its publication."""
        if stage != "train":
            return None
        return {"grad_norm" if name == "default" else f"grad_norm_{name}": norm for name, norm in self._latest.items()}

    @hookfit.hookimpl
    def stage_end(self, stage: str) -> None:
        if stage == "train":  # after optim's tryfirst stage_end, which may step a partial window
            self.read()
