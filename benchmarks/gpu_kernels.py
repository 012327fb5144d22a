"""What a training step launches on a CUDA device: a raw loop's kernels against the default
stack's (optim's managed step, metrics, console, interrupter), each counted with
``torch.profiler`` over the same number of steps in the middle of an epoch, and the kernels the
stack adds, by name. On an accelerator a kernel is a launch a step, paid on the host. Needs a
GPU: ``python benchmarks/gpu_kernels.py [--steps 20]``; ``--device cpu`` counts torch's
operators on the CPU instead (the CPU path: no kernels, host reads of the loss)."""
from __future__ import annotations

import argparse
import collections
import io
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import hookfit
from hookfit.plugins.console import Console
from hookfit.plugins.interrupter import Interrupter
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (the tiny model and its steps, as overhead.py times them)


def kernels(prof: profile, cuda: bool) -> collections.Counter[str]:
    """The device's kernels (and memory operations) the profile saw, by name; on the CPU,
    torch's operators."""
    if cuda:
        return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class Window:
    """Profiles training steps ``first`` to ``first + steps - 1`` of the run."""

    def __init__(self, first: int, steps: int, cuda: bool) -> None:
        self.first, self.last, self.cuda = first, first + steps - 1, cuda
        self.prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])

    @hookfit.hookimpl(tryfirst=True)
    def batch_start(self, loop: hookfit.Run, batch_idx: int) -> None:
        if loop.training and batch_idx == self.first:
            sync(self.cuda)
            self.prof.__enter__()

    @hookfit.hookimpl(trylast=True)
    def batch_end(self, loop: hookfit.Run, batch_idx: int) -> None:
        if loop.training and batch_idx == self.last:
            sync(self.cuda)
            self.prof.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps counted (default 20)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="default cuda")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_kernels.py needs a CUDA device (--device cpu counts torch's operators on the CPU)", file=sys.stderr)
        return 2
    n, first = args.steps, 10
    workload = overhead.model_workload(first + n + 10, device=args.device)  # overhead.py's tiny model
    raw = workload.make()  # its step steps torch's SGD as users build it: torch picks the kernel
    prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
    for i, batch in enumerate(workload.data):
        if i == first:
            sync(cuda)
            prof.__enter__()
        raw.step(None, batch)
        if i == first + n - 1:
            sync(cuda)
            prof.__exit__(None, None, None)
    raw_kernels = kernels(prof, cuda)

    parts = workload.make()  # the managed step of the README's first script
    window = Window(first, n, cuda)
    hookfit.Loop(parts.managed_step, workload.data, model=parts.model, optimizers=parts.optimizer, max_epochs=1,
                 plugins=[Optim(), Metrics(), Console(stream=io.StringIO()), Interrupter(signals=False),
                          window]).fit()
    stack = kernels(window.prof, cuda)
    what = "kernels" if cuda else "operators"
    print(f"{what} a step over {n} steps: raw {sum(raw_kernels.values()) / n:.2f}, "
          f"default stack {sum(stack.values()) / n:.2f}")
    for name in sorted(set(raw_kernels) | set(stack)):
        if raw_kernels[name] != stack[name]:
            print(f"  {(stack[name] - raw_kernels[name]) / n:+.2f} a step  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
