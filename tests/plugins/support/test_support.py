"""hookfit.plugins.support: the helpers plugins share (built-in and third-party alike)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hookfit.errors import HookfitWarning
from hookfit.plugins import support as common


# -- option checking -------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: common.positive_int("p", "o", 0), "p: o must be a positive integer, got 0"),
    (lambda: common.positive_int("p", "o", True), "p: o must be a positive integer, got True"),
    (lambda: common.positive_int("p", "o", 2.0, none=True, meaning="steps"),
     "p: o must be a positive integer (steps) or None, got 2.0"),
    (lambda: common.integer("p", "o", -1, least=0, meaning="epochs"), "p: o must be an integer >= 0 (epochs), got -1"),
    (lambda: common.integer("p", "o", "1"), "p: o must be an integer, got '1'"),
    (lambda: common.number("p", "o", math.nan, least=0), "p: o must be a finite number >= 0, got nan"),
    (lambda: common.number("p", "o", "1"), "p: o must be a finite number, got '1'"),
    (lambda: common.positive_number("p", "o", math.inf, none=True, meaning="seconds"),
     "p: o must be a positive finite number (seconds) or None, got inf"),
    (lambda: common.positive_number("p", "o", 10**400), f"p: o must be a positive finite number, got {10**400!r}"),
    (lambda: common.positive_number("p", "o", False), "p: o must be a positive finite number, got False"),
    (lambda: common.choice("p", "o", "x", ("a", "b")), "p: o must be 'a' or 'b', got 'x'"),
    (lambda: common.choice("p", "o", "x", ("a", "b", "c")), "p: o must be one of 'a', 'b', 'c', got 'x'"),
    (lambda: common.choice("p", "o", 1, ("a", "b"), none=True), "p: o must be 'a', 'b' or None, got 1"),
    (lambda: common.choice("p", "o", True, (1, 2)), "p: o must be 1 or 2, got True"),
    (lambda: common.flag("p", "o", 1), "p: o must be True or False, got 1"),
    (lambda: common.flag("p", "o", "yes", none=True), "p: o must be True, False or None, got 'yes'"),
    (lambda: common.text("p", "o", " "), "p: o must be a non-empty string, got ' '"),
    (lambda: common.path("p", "o", 5, none=True, what="a folder"),
     "p: o must be a folder (a str or os.PathLike) or None, got 5"),
    (lambda: common.check("p", "o", "a", lambda v: v > 0, "be above 0"), "p: o must be above 0, got 'a'"),
])
def test_a_bad_option_is_one_value_error_naming_the_plugin_the_option_and_the_value(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call()


def test_good_options_come_back_as_what_the_plugin_stores() -> None:
    assert common.positive_int("p", "o", 3) == 3 and common.positive_int("p", "o", None, none=True) is None
    assert common.integer("p", "o", 0, least=0) == 0
    assert common.number("p", "o", 0, least=0) == 0.0 and isinstance(common.number("p", "o", 2), float)
    assert common.positive_number("p", "o", 5) == 5.0
    assert common.choice("p", "o", "b", ("a", "b")) == "b" and common.choice("p", "o", None, ("a",), none=True) is None
    assert common.flag("p", "o", False) is False and common.flag("p", "o", None, none=True) is None
    assert common.text("p", "o", "gloo") == "gloo"
    assert common.path("p", "o", Path("x")) == Path("x") and common.path("p", "o", "x") == "x"


def test_an_error_can_be_a_type_error_and_show_a_value_by_its_type() -> None:
    error = common.option_error("p", "stream", "out.txt", "be a text stream", TypeError, shown="str")
    assert isinstance(error, TypeError) and str(error) == "p: stream must be a text stream, got str"


# -- cadence ---------------------------------------------------------------------------------

def test_every_n_is_due_at_each_multiple_of_n_counted_from_1_and_never_without_n() -> None:
    assert [c for c in range(10) if common.Every(3).due(c)] == [3, 6, 9]
    assert [c for c in range(4) if common.Every(1).due(c)] == [1, 2, 3]
    never = common.Every(None)
    assert never.never and not common.Every(2).never and not any(never.due(c) for c in range(10))
    assert common.Every(2) == common.Every(2) != common.Every(3) and repr(common.Every(2)) == "Every(2)"


@pytest.mark.parametrize("n, start, stop", [(3, 0, 9), (3, 2, 3), (3, 3, 5), (2, 5, 5), (4, 7, 2), (1, 0, 6)])
def test_between_counts_the_due_events_after_start_up_to_stop(n: int, start: int, stop: int) -> None:
    every = common.Every(n)
    assert every.between(start, stop) == sum(every.due(c) for c in range(start + 1, stop + 1))
    assert common.Every(None).between(start, stop) == 0


@pytest.mark.parametrize("n", [0, -1, 2.0, "3", True])
def test_every_checks_n_and_names_the_plugin_and_option(n: Any) -> None:
    with pytest.raises(ValueError, match=rf"^ema: every_n_steps must be a positive integer \(optimizer steps\), "
                                         rf"got {re.escape(repr(n))}$"):
        common.Every(n, plugin="ema", option="every_n_steps", none=False, meaning="optimizer steps")
    with pytest.raises(ValueError, match=r"^ema: every_n_steps must be a positive integer \(optimizer steps\), got None"):
        common.Every(None, plugin="ema", option="every_n_steps", none=False, meaning="optimizer steps")


# -- best values -----------------------------------------------------------------------------

def test_a_monitor_keeps_the_first_of_the_best_values_and_never_a_nan_or_an_infinity() -> None:
    low = common.Monitor("valid/loss")
    assert (low.stage, low.key, low.best) == ("valid", "loss", None)
    taken = [low.update(v, at=i) for i, v in enumerate([math.nan, 2.0, 2.0, 1.0, -math.inf, math.inf, 1.5])]
    assert taken == [False, True, False, True, False, False, False] and low.record == (1.0, 3)
    high = common.Monitor(mode="max", min_delta=0.5)
    assert [high.update(v, at=i) for i, v in enumerate([1.0, 1.4, 1.6, 2.0])] == [True, False, True, False]
    assert (high.best, high.best_at) == (1.6, 2) and high.metric is None


@pytest.mark.bad_input
def test_a_metric_named_as_higher_is_better_compared_by_the_default_min_is_warned_of_once_a_run() -> None:
    """The direction is never taken from the name (given, else published, else "min"); but a
    monitor of ``valid/acc`` left at the default "min" kept the worst epoch as the best and
    stopped the run when accuracy rose, without a word."""
    import warnings

    def said(metric: str, published: dict[str, str], **options: Any) -> list[str]:
        monitor = common.Monitor(metric, plugin="early_stopping", **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            modes = [monitor.follow(published), monitor.follow(published)]
            monitor.start()
            modes.append(monitor.follow(published))  # a new run: warned again
        assert set(modes) == {options.get("mode") or published.get(metric.split("/")[1], "min")}
        return [str(w.message) for w in caught]

    for metric in ("valid/acc", "valid/top1_accuracy", "train/f1", "valid/mAP50", "valid/val_auroc", "valid/dice"):
        assert said(metric, {}) == [
            f"early_stopping: {metric} is compared as lower is better ('min', the default: early_stopping was given no "
            f"mode and Metrics(best=...) names no direction for it); if higher is better, give mode='max' or "
            f"Metrics(best={{{metric!r}: 'max'}})"] * 2, metric
    for metric in ("valid/loss", "valid/mse", "valid/accumulated_loss", "valid/error_rate", "valid/perplexity"):
        assert said(metric, {}) == [], metric
    assert said("valid/acc", {"acc": "max"}) == [] and said("valid/acc", {"acc": "min"}) == []  # published
    assert said("valid/acc", {}, mode="min") == [] and said("valid/acc", {}, mode="max") == []  # given


def test_a_published_direction_that_contradicts_the_given_mode_is_told_once_a_run_and_warns_nothing() -> None:
    """``contradicted`` is what ``follow`` warns of, for a plugin that warns in its own words (optim's plateau)."""
    import warnings

    monitor = common.Monitor("valid/acc", mode="min", plugin="optim")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        told = [monitor.contradicted({"acc": "min"}), monitor.contradicted({}), monitor.contradicted({"acc": "max"}),
                monitor.contradicted({"acc": "max"})]
        monitor.start()
        told.append(monitor.contradicted({"acc": "max"}))  # a new run: told again
    assert told == [None, None, "max", None, "max"]
    assert common.Monitor("valid/acc").contradicted({"acc": "max"}) is None  # no mode given: it follows
    given = common.Monitor("valid/acc", mode="min", plugin="checkpoint")  # follow warns of it, once a run
    with pytest.warns(HookfitWarning) as caught:
        assert [given.follow({"acc": "max"}), given.follow({"acc": "max"})] == ["min", "min"]
    assert [str(w.message) for w in caught] == [
        "checkpoint: mode='min' for valid/acc, whose direction the metrics plugin publishes as 'max' "
        "(Metrics(best=...)); checkpoint keeps 'min': leave mode out to follow the metrics plugin"]


def test_a_monitor_restores_a_saved_best_and_forgets_one_that_is_not_finite() -> None:
    monitor = common.Monitor("train/acc", mode="max")
    monitor.reset(0.5, at=(1, 10))
    assert monitor.record == (0.5, (1, 10)) and not monitor.improves(0.5) and monitor.improves(0.6)
    monitor.reset(math.nan, at=(1, 10))
    assert monitor.record is None and monitor.improves(0.0)
    monitor.reset()
    assert monitor.best is None and monitor.best_at is None


@pytest.mark.parametrize("options, message", [
    ({"metric": "loss"}, "monitor must be '<stage>/<metric>' with stage train or valid (like 'valid/loss'), or None, "
                         "got 'loss'"),
    ({"metric": "test/loss"}, "monitor must be '<stage>/<metric>'"),
    ({"metric": "valid/ "}, "monitor must be '<stage>/<metric>'"),
    ({"metric": 3}, "monitor must be '<stage>/<metric>'"),
    ({"mode": "best"}, "mode must be 'min' or 'max', got 'best'"),
    ({"min_delta": -0.1}, "min_delta must be a finite number >= 0, got -0.1"),
    ({"min_delta": math.inf}, "min_delta must be a finite number >= 0, got inf"),
])
def test_a_monitor_checks_its_options_naming_the_plugin(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^my_plugin: " + re.escape(message)):
        common.Monitor(plugin="my_plugin", **options)


# -- models ----------------------------------------------------------------------------------

def test_unwrap_model_looks_through_data_parallel_and_compile_however_nested() -> None:
    import torch

    plain = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.BatchNorm1d(1))
    compiled = torch.compile(plain, backend="eager")
    assert common.unwrap_model(plain) is plain and common.unwrap_model(compiled) is plain
    assert common.unwrap_model(torch.nn.DataParallel(compiled)) is plain
    assert common.unwrap_model(torch.compile(torch.nn.DataParallel(plain), backend="eager")) is plain
    assert common.unwrap_model(torch.nn.DataParallel(compiled), compiled=False) is compiled


def test_unwrap_state_dict_gives_a_compiled_modules_state_the_plain_modules_keys() -> None:
    import torch

    plain = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.BatchNorm1d(1))
    state = torch.compile(plain, backend="eager").state_dict()
    assert all(key.startswith("_orig_mod.") for key in state)
    unwrapped = common.unwrap_state_dict(state)
    assert list(unwrapped) == list(plain.state_dict())
    assert unwrapped._metadata.keys() == plain.state_dict()._metadata.keys()  # type: ignore[attr-defined]
    plain.load_state_dict(unwrapped)
    own = plain.state_dict()
    assert common.unwrap_state_dict(own) is own and common.unwrap_state_dict({}) == {}


# -- GradientWatch ------------------------------------------------------------------------------
def test_a_gradient_watch_sees_each_gradient_and_leaves_no_hook_of_torch_s_behind() -> None:
    """Until it is removed, the watch is called for each parameter's gradient. After, torch's
    own hook goes too: the hook dictionary the watch made is no longer read by any backward
    pass (a handle's remove() alone leaves it read, empty, by every pass, for each parameter)."""
    from hookfit.plugins.support import GradientWatch

    model = torch.nn.Linear(3, 2)
    seen: list[torch.Tensor] = []
    watch = GradientWatch(model.parameters(), seen.append)
    assert len(watch) == 2
    model(torch.ones(1, 3)).sum().backward()
    assert sorted(tuple(g.shape) for g in seen) == [(2,), (2, 3)]
    made = [p._backward_hooks for p in model.parameters()]  # the dictionaries torch reads
    watch.remove()
    assert len(watch) == 0 and all(p._backward_hooks is None for p in model.parameters())
    late: list[object] = []
    for hooks in made:  # were torch still reading them, these would be called
        hooks[10**6] = late.append
    model(torch.ones(1, 3)).sum().backward()
    assert late == [] and len(seen) == 2


def test_a_gradient_watch_keeps_the_hooks_that_others_put_on_the_same_tensors() -> None:
    from hookfit.plugins.support import GradientWatch

    before, during = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    calls: list[str] = []
    before.register_hook(lambda g: calls.append("before"))
    watch = GradientWatch([before, during], lambda g: calls.append("watch"))
    during.register_hook(lambda g: calls.append("during"))
    watch.remove()
    ((before + during) * 2).sum().backward()
    assert sorted(calls) == ["before", "during"]


def test_a_gradient_watch_on_a_tensor_subclass_is_told_after_accumulation() -> None:
    """A subclass (FSDP2's DTensor) gets a post-accumulate-grad hook: FSDP2 runs those itself
    once it has set the sharded gradient, which autograd never accumulates."""
    from hookfit.plugins.support import GradientWatch

    class Sub(torch.nn.Parameter):
        pass

    param = Sub(torch.zeros(2))
    seen: list[torch.Tensor] = []
    watch = GradientWatch([param], seen.append)
    (param * 3).sum().backward()
    assert seen == [param] and torch.equal(seen[0].grad, torch.full((2,), 3.0))
    watch.remove()
    (param * 3).sum().backward()
    assert len(seen) == 1


# -- Accumulation -------------------------------------------------------------------------------
def test_an_accumulation_is_told_of_backward_once_a_call_and_never_of_autograd_grad() -> None:
    """``torch.autograd.grad`` computes the parameters' gradients (their hooks see them) and leaves ``.grad``
    alone; ``backward()`` sets it, then adds onto it in place: each such call is told once, as it ends."""
    from hookfit.plugins.support import Accumulation, GradientWatch

    model = torch.nn.Linear(3, 2)
    params, told = list(model.parameters()), []
    accumulation = Accumulation(params, lambda: told.append(tuple(p.grad is not None for p in params)))
    arrived: list[torch.Tensor] = []

    def arrive(grad: torch.Tensor) -> None:
        arrived.append(grad)
        accumulation.arrived(grad)

    watch = GradientWatch(params, arrive)
    loss = lambda: model(torch.ones(4, 3)).pow(2).sum()  # noqa: E731
    grads = torch.autograd.grad(loss(), params, create_graph=True)
    assert len(arrived) == 2 and told == [] and all(p.grad is None for p in params)
    sum(g.pow(2).sum() for g in grads).backward()  # a penalty on them, back-propagated: told
    assert told == [(True, True)]
    model.zero_grad(set_to_none=False)
    torch.autograd.grad(loss(), params)
    assert len(arrived) == 6 and len(told) == 1
    loss().backward()  # onto the zeros, in place
    assert len(told) == 2
    watch.remove()


def test_an_accumulation_after_a_call_that_failed_still_tells_the_next() -> None:
    """A call that raises runs no final callback and is told nothing; the next call is told as it ends."""
    from hookfit.plugins.support import Accumulation, GradientWatch

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise ValueError("failed")

    param, other = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    told: list[int] = []
    arrived: list[torch.Tensor] = []
    accumulation = Accumulation([param], lambda: told.append(1))

    def arrive(grad: torch.Tensor) -> None:
        arrived.append(grad)
        accumulation.arrived(grad)

    watch = GradientWatch([param], arrive)
    failing = Fails.apply(other).sum()  # made first, so its backward runs after param's gradient arrived
    with pytest.raises(ValueError, match="failed"):
        torch.autograd.grad(failing + (param * 3).sum(), [param, other])
    assert len(arrived) == 1
    param.grad = torch.ones(2)  # what a pass it is not told of leaves (optim's own)
    torch.autograd.grad((param * 3).sum(), [param])  # judged from its own beginning, not the failed call's
    assert told == []
    (param * 3).sum().backward()
    assert told == [1]
    watch.remove()


def test_an_accumulation_of_a_tensor_subclass_is_told_at_once() -> None:
    """A subclass's hook (post-accumulate-grad: FSDP2 runs it once it set the gradient) is an accumulation."""
    from hookfit.plugins.support import Accumulation, GradientWatch

    class Sub(torch.nn.Parameter):
        pass

    param, told = Sub(torch.zeros(2)), []
    accumulation = Accumulation([param], lambda: told.append(param.grad is not None))
    watch = GradientWatch([param], accumulation.arrived)
    (param * 3).sum().backward()
    assert told == [True]
    watch.remove()


# -- which ranks have a flag set ---------------------------------------------------------------

def test_ranks_where_names_the_ranks_whose_flag_is_set_as_the_all_reduce_sums_them() -> None:
    """Each rank gives 1.0 at its own index; the ``all_reduce`` event's sum names every rank that set it
    (``None`` where none did); with one process, or ``all_reduce`` answered ``None``, its own flag alone."""
    from types import SimpleNamespace

    from hookfit.plugins.support.ranks import ranks_where

    def rank(number: int, world: int, others: list[float], answered: bool = True) -> Any:
        summed = lambda loop, mine: mine + torch.tensor(others)  # noqa: E731 - the other ranks' flags added
        return SimpleNamespace(state=SimpleNamespace(rank=number, world_size=world),
                               hooks=SimpleNamespace(all_reduce=summed if answered else lambda loop, mine: None))

    assert ranks_where(rank(1, 3, [1.0, 0.0, 1.0]), True) == "ranks 0, 1, 2"
    assert ranks_where(rank(1, 3, [0.0, 0.0, 1.0]), False) == "rank 2"
    assert ranks_where(rank(1, 3, [0.0, 0.0, 0.0]), False) is None
    assert ranks_where(rank(0, 1, [5.0]), True) == "rank 0"  # one process: no collective operation
    assert ranks_where(rank(1, 2, [1.0, 0.0], answered=False), True) == "rank 1"


def test_few_parameters_names_the_model_s_by_name_others_by_shape_and_counts_the_rest() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    names, apart = common.parameter_names(net), torch.zeros(5)
    assert common.few_parameters([net[0].weight, apart, net[0].bias], names) == "0.weight, a tensor of shape (5,), 0.bias"
    assert common.few_parameters([apart] * 6, {}, shown=1) == "a tensor of shape (5,), and 5 more"
