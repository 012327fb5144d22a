"""optim with sparse gradients (``nn.EmbeddingBag(sparse=True)`` under ``SparseAdam``, an MLP under ``Adam``), as a
recommender trains: ``check_grads`` checks a sparse gradient by its coalesced values and skips as a plain script's
check does, bit for bit; a clip of an optimizer with sparse gradients is refused before the first batch (or at the
step that shows one) naming the optimizer, the parameter and what to do; ``clip_norm``/``clip_value`` by optimizer
name clip only those named, the epoch's last, partial window of data without a ``len()`` too, bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.optim import Optim
from hookfit.plugins.support.sparse import SparseClipError
from test_optim import assert_bitwise

N_ITEMS, DIM, CLIP = 30, 4, 0.05


class Rec(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.items = torch.nn.EmbeddingBag(N_ITEMS, DIM, mode="sum", sparse=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.items(ids)).squeeze(1)


def build() -> tuple[Rec, dict[str, torch.optim.Optimizer]]:
    m = Rec()
    return m, {"sparse": torch.optim.SparseAdam([m.items.weight], lr=0.01),
               "dense": torch.optim.Adam(m.mlp.parameters(), lr=0.01)}


def batches(n: int = 10, zero_rows_at: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(item ids with repeats, so that the sparse gradient is uncoalesced; labels; whether the batch adds a term
    whose value is finite and whose gradient is NaN at an all-zero row)."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, N_ITEMS, (6, 3), generator=g), torch.rand(6, generator=g), i in zero_rows_at)
            for i in range(n)]


def loss_of(m: Rec, batch) -> torch.Tensor:
    ids, y, nan_grad = batch
    loss = torch.nn.functional.mse_loss(m(ids), y)
    if nan_grad:  # sqrt of a squared norm at a row of zeros: a finite loss, a NaN in the sparse gradient only
        loss = loss + 1e-3 * m.items(ids[:, :1], per_sample_weights=None).pow(2).sum(1).sqrt().mean()
    return loss


class Stream:
    """Training data without a ``len()``, as an ``IterableDataset`` streams it."""

    def __init__(self, items) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def fit(m: Rec, opts, data, *plugins, epochs: int = 1):
    def step(loop, batch):
        loss = loss_of(loop.model, batch)
        loop.backward(loss)
        for name in ("sparse", "dense"):
            loop.optimizers[name].step()
        for name in ("sparse", "dense"):
            loop.optimizers[name].zero_grad()
        return {"loss": loss}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hookfit.Loop(step, data, model=m, optimizers=opts, max_epochs=epochs, run_dir=None,
                            plugins=list(plugins)).fit()


def params(m: Rec) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def test_check_grads_skips_a_step_whose_sparse_gradient_is_not_finite_as_a_plain_script_does() -> None:
    data = batches(10, zero_rows_at=(2, 7))
    m, opts = build()
    with torch.no_grad():
        m.items.weight[:N_ITEMS // 2].zero_()  # rows a batch's first item may hit: NaN gradients there
    raw_skips = {"sparse": 0, "dense": 0}
    for batch in data:
        loss_of(m, batch).backward()
        for name, opt in opts.items():
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if all(bool(torch.isfinite(g.coalesce().values() if g.is_sparse else g).all()) for g in grads):
                opt.step()
            else:
                raw_skips[name] += 1
        for opt in opts.values():
            opt.zero_grad()
    assert raw_skips["sparse"] >= 1 and raw_skips["dense"] == 0  # the case the check is for
    assert not torch.isnan(m.items.weight).any()
    h, h_opts = build()
    with torch.no_grad():
        h.items.weight[:N_ITEMS // 2].zero_()
    state = fit(h, h_opts, data, Optim(check_grads=True))
    assert state.status == "completed" and state.results["skipped_steps"] == sum(raw_skips.values())
    assert "non-finite gradient" in state.results["first_skip"]
    assert_bitwise(params(h), params(m))


@pytest.mark.bad_input
@pytest.mark.parametrize("options", [{"clip_norm": 1.0}, {"clip_norm": 1.0, "clip_scope": "model"},
                                     {"clip_value": 1.0}, {"clip_norm": {"sparse": 1.0}}])
def test_a_clip_of_an_optimizer_with_sparse_gradients_is_refused_before_the_first_batch(options) -> None:
    m, opts = build()
    steps = []
    with pytest.raises(SparseClipError) as raised:
        hookfit.Loop(lambda loop, batch: steps.append(batch), batches(2), model=m, optimizers=opts, run_dir=None,
                     plugins=[Optim(**options)]).fit()
    message = str(raised.value)
    option = next(iter(o for o in options if o != "clip_scope"))
    assert steps == [] and f"{option} cannot clip optimizer 'sparse' (torch.optim.sparse_adam.SparseAdam)" in message
    assert "'items.weight' gets sparse gradients" in message and "sparse=False" in message
    assert f"Optim({option}={{'dense': 1.0}})" in message  # the optimizers it can clip


@pytest.mark.bad_input
def test_a_sparse_gradient_a_clip_meets_at_a_step_is_refused_there_naming_the_parameter() -> None:
    m = torch.nn.Linear(DIM, 1)
    table = torch.nn.Parameter(torch.randn(N_ITEMS, DIM))  # functional embedding: no module says it is sparse
    holder = torch.nn.ModuleDict({"mlp": m})
    holder.register_parameter("table", table)
    opts = {"table": torch.optim.SGD([table], lr=0.1), "mlp": torch.optim.SGD(m.parameters(), lr=0.1)}

    def step(loop, batch):
        ids, y, _ = batch
        loss = torch.nn.functional.mse_loss(m(torch.nn.functional.embedding(ids[:, 0], table, sparse=True)).squeeze(1), y)
        loop.backward(loss)
        for opt in loop.optimizers.values():
            opt.step()
        return {"loss": loss}

    with pytest.raises(SparseClipError, match=r"clip_value cannot clip optimizer 'table' .*'table' gets sparse "
                                              r"gradients.*Optim\(clip_value=\{'mlp': 1.0\}\)"):
        hookfit.Loop(step, batches(2), model=holder, optimizers=opts, run_dir=None,
                     plugins=[Optim(clip_value=1.0)]).fit()


def raw_dense_clip(data, accumulate: int, clip: str) -> list[torch.Tensor]:
    """Plain torch: the dense optimizer's gradients clipped before each of its steps, every window's, the epoch's
    last, partial one too (each loss divided by ``accumulate``, as optim does without a ``len()``)."""
    m, opts = build()
    for i, batch in enumerate(data):
        (loss_of(m, batch) / accumulate).backward()
        if (i + 1) % accumulate and i != len(data) - 1:
            continue
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(m.mlp.parameters(), CLIP)
        else:
            torch.nn.utils.clip_grad_value_(m.mlp.parameters(), CLIP / 10)
        for opt in opts.values():
            opt.step()
        for opt in opts.values():
            opt.zero_grad()
    return params(m)


@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("accumulate", [1, 4])
def test_a_clip_by_optimizer_name_clips_that_optimizer_only_every_window_the_partial_one_too(clip, accumulate) -> None:
    data = batches(10)  # windows of 4, 4 and 2 under accumulate=4, in a stream without a len()
    m, opts = build()
    option = {"clip_norm": {"dense": CLIP}} if clip == "norm" else {"clip_value": {"dense": CLIP / 10}}
    state = fit(m, opts, Stream(data), Optim(accumulate=accumulate, **option))
    assert state.status == "completed"
    assert_bitwise(params(m), raw_dense_clip(data, accumulate, clip))
    unclipped, unclipped_opts = build()  # the clip changed something: the same run without it differs
    fit(unclipped, unclipped_opts, Stream(data), Optim(accumulate=accumulate))
    assert any(not torch.equal(a, b) for a, b in zip(params(unclipped), params(m)))


@pytest.mark.bad_input
def test_a_clip_naming_an_optimizer_the_run_does_not_have_is_refused_at_the_start_naming_the_known_ones() -> None:
    m, opts = build()
    steps = []
    with pytest.raises(ValueError, match=r"optim: clip_norm names 'Dense', which this run does not have: its "
                                         r"optimizers are 'sparse', 'dense'"):
        hookfit.Loop(lambda loop, batch: steps.append(batch), batches(2), model=m, optimizers=opts, run_dir=None,
                     plugins=[Optim(clip_norm={"Dense": 1.0})]).fit()
    assert steps == []


@pytest.mark.bad_input
@pytest.mark.parametrize("options, message", [
    ({"clip_norm": {"dense": 1.0}, "clip_scope": "model"}, "clip_scope='model' clips one norm over every optimizer"),
    ({"clip_norm": {"dense": -1.0}}, "clip_norm['dense'] must be a positive finite number, got -1.0"),
    ({"clip_value": {}}, "clip_value must be a positive finite number, a dict of names to positive finite numbers"),
    ({"clip_norm": {1: 1.0}}, "clip_norm must be a positive finite number, a dict of names"),
])
def test_a_clip_by_name_that_makes_no_sense_is_refused_when_optim_is_built(options, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Optim(**options)


def test_a_validation_with_a_clip_by_name_needs_no_optimizer() -> None:
    """``Loop.validate()`` has no optimizers: the names of a clip by name are not checked against none."""
    m, _ = build()
    state = hookfit.Loop(lambda loop, batch: None, [], val_step=lambda loop, batch: {"loss": loss_of(m, batch)},
                         val_data=batches(2), model=m, run_dir=None,
                         plugins=[Optim(clip_norm={"dense": 1.0})]).validate()
    assert state.status == "completed"
