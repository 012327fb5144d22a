"""The device path's non-finite flag: a window's first loss checked into a zero made ahead of time
with one kernel (``flags.Flags``, which optim's device path takes), any other with two (``flags.loss_flag``), instead of
``isfinite``'s five; the same answer as ``isfinite`` for every kind of value and dtype, and the
loss left as it was."""

from __future__ import annotations

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from hookfit.plugins.support import flags as flags_module
from hookfit.plugins.support.flags import Flags, loss_flag

VALUES = [0.0, -0.0, 1.5, -3e38, 3e38, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", VALUES)
def test_the_flag_is_one_exactly_where_isfinite_is_false(dtype, value) -> None:
    loss = torch.tensor(value).to(dtype)  # (3e38 overflows to inf in float16: the flag follows)
    flag = loss_flag(loss)
    assert flag.dtype == torch.float32 and flag.dim() == 0  # what the fused kernels take as found_inf
    assert flag.item() == (0.0 if bool(torch.isfinite(loss)) else 1.0)


def test_a_loss_of_several_values_is_flagged_if_any_is_not_finite_and_keeps_its_graph() -> None:
    w = torch.ones(3, requires_grad=True)
    loss = w * torch.tensor([1.0, float("nan"), 2.0])
    assert loss_flag(loss).item() == 1.0 and loss_flag(w * 2).item() == 0.0
    loss.sum().backward()  # the flag read nothing in place: the graph is intact
    assert w.grad is not None


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as integers of the same size: compared bit for bit."""
    return t.detach().reshape(1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class Ops(TorchDispatchMode):
    """The operators torch runs inside the ``with`` block (a kernel each, but ``detach``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", VALUES + [1e-45, -2.5e-40])
def test_a_windows_first_flag_is_one_kernel_with_the_same_answer_and_the_loss_untouched(dtype, value) -> None:
    w = torch.tensor(1.0, dtype=dtype, requires_grad=True)
    loss = w * torch.tensor(value).to(dtype)  # (1e-45 and -2.5e-40: float32's subnormals)
    assert loss.dtype == dtype
    before, version = bits(loss).clone(), loss._version
    flags = Flags()
    flags.check(w * 1.0)  # the zeros are made at the first check: not this loss's work
    with Ops() as seen:
        flag = flags.check(loss)
    assert [op for op in seen.ops if op != "detach.default"] == ["_amp_foreach_non_finite_check_and_unscale_.default"]
    assert flag.dtype == torch.float32 and flag.dim() == 0
    assert flag.item() == (0.0 if bool(torch.isfinite(loss)) else 1.0)
    # the values, bit for bit (a NaN stays a NaN), and autograd's version of the loss: unchanged
    assert loss._version == version
    assert torch.equal(bits(loss), before) or value != value
    if value == value:
        (loss * loss).backward()  # a graph that saved the loss itself is still usable
        assert w.grad is not None


def test_each_window_gets_a_flag_of_its_own_that_later_checks_leave_as_it_was(monkeypatch) -> None:
    monkeypatch.setattr(flags_module, "SLOTS", 3)  # so the run crosses two refills
    flags = Flags()
    values = [1.0, float("nan"), 2.0, float("inf"), 3.0, 4.0, float("-inf"), 5.0]
    made = [flags.check(torch.tensor(v)) for v in values]
    assert [f.item() for f in made] == [0.0 if abs(v) < float("inf") else 1.0 for v in values]
    assert len({(f.untyped_storage().data_ptr(), f.storage_offset()) for f in made}) == len(values)


def test_a_loss_the_one_kernel_check_refuses_is_flagged_with_two() -> None:
    flags = Flags()
    assert flags.check(torch.tensor(3)).item() == 0.0  # an integer loss: torch's check refuses it
    assert flags.check(torch.tensor(float("nan"))).item() == 1.0  # from then on, two kernels
    with Ops() as seen:
        flags.check(torch.tensor(1.0))
    assert "_amp_foreach_non_finite_check_and_unscale_.default" not in seen.ops

    class Sub(torch.Tensor):
        pass

    fresh = Flags()
    assert fresh.check(torch.tensor([1.0, float("inf")]).as_subclass(Sub)).item() == 1.0
    assert fresh._slots == ()  # a subclass (a DTensor, say) is never given to it
