"""The device path's non-finite flag (``nonfinite._flag``): two kernels instead of five, and the
same answer as ``isfinite`` for every kind of value and dtype."""

from __future__ import annotations

import pytest
import torch

from hookfit.plugins.optim.nonfinite import _flag

VALUES = [0.0, -0.0, 1.5, -3e38, 3e38, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", VALUES)
def test_the_flag_is_one_exactly_where_isfinite_is_false(dtype, value) -> None:
    loss = torch.tensor(value).to(dtype)  # (3e38 overflows to inf in float16: the flag follows)
    flag = _flag(loss)
    assert flag.dtype == torch.float32 and flag.dim() == 0  # what the fused kernels take as found_inf
    assert flag.item() == (0.0 if bool(torch.isfinite(loss)) else 1.0)


def test_a_loss_of_several_values_is_flagged_if_any_is_not_finite_and_keeps_its_graph() -> None:
    w = torch.ones(3, requires_grad=True)
    loss = w * torch.tensor([1.0, float("nan"), 2.0])
    assert _flag(loss).item() == 1.0 and _flag(w * 2).item() == 0.0
    loss.sum().backward()  # the flag read nothing in place: the graph is intact
    assert w.grad is not None
