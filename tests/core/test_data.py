"""hookfit.data.Batches, checked against references computed independently: DataLoader over a
TensorDataset (and DistributedSampler for shards) when unshuffled, the permutation property
and the seed's determinism when shuffled."""

from __future__ import annotations

import re
import io

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hookfit.data
from hookfit.data import Batches, epoch_seed


def data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose first column is their own index, so a batch says which samples it holds."""
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    x[:, 1:] = torch.randn(n, 2, generator=torch.Generator().manual_seed(n))
    return x, torch.arange(n) * 10


def ids(batches) -> list[int]:
    """The sample indices, in order, of an iterable of (x, y) batches."""
    return [int(i) for x, _ in batches for i in x[:, 0]]


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is tuple and len(g) == len(w)
        assert all(torch.equal(a, b) for a, b in zip(g, w))


# -- validation -------------------------------------------------------------------------------
@pytest.mark.bad_input
def test_a_stage_over_several_validation_sets_counts_the_batches_of_all():
    """``len()`` of ``Loop(val_data={...})`` counts the sets; a stage runs the batches of all."""
    sets = {"clean": [1, 2], "noisy": DataLoader(TensorDataset(torch.zeros(5)), batch_size=2)}
    assert len(sets) == 2 and hookfit.data.stage_length(sets) == 5
    assert hookfit.data.stage_length([1, 2, 3]) == 3
    assert hookfit.data.stage_length({"clean": [1], "stream": iter([1])}) is None  # one cannot say


def test_lengths_must_agree_and_are_named():
    with pytest.raises(ValueError, match=r"\[10, 9\]"):
        Batches(torch.zeros(10, 2), torch.zeros(9), batch_size=4)


@pytest.mark.bad_input
@pytest.mark.parametrize("size", [0, -1, 2.0, True, None])
def test_batch_size_must_be_a_positive_int(size):
    with pytest.raises(ValueError, match="batch_size"):
        Batches(torch.zeros(10), batch_size=size)


@pytest.mark.bad_input
@pytest.mark.parametrize("seed, shown", [(1.5, "1.5"), (torch.tensor(1.5), r"tensor\(1\.5000\)"), ("3", "'3'"),
                                         (True, "True")])
def test_a_seed_that_is_not_an_integer_is_named(seed, shown):
    """torch's "only integer tensors of a single element can be converted to an index" named neither Batches nor
    its seed; a bool was taken as 1."""
    with pytest.raises(TypeError, match=rf"^Batches: seed must be an int, not {shown}$"):
        Batches(torch.zeros(10), batch_size=2, shuffle=True, seed=seed)


def test_a_numpy_batch_size_is_the_plain_int_it_holds():
    import numpy

    batches = Batches(torch.arange(10), batch_size=numpy.int64(4))
    assert type(batches.batch_size) is int and [len(b[0]) for b in batches] == [4, 4, 2]


@pytest.mark.bad_input
def test_no_samples_no_tensors_and_0d_tensors_are_refused():
    with pytest.raises(ValueError, match="0 rows"):
        Batches(torch.zeros(0, 3), batch_size=4)
    with pytest.raises(ValueError, match="at least one tensor"):
        Batches(batch_size=4)
    with pytest.raises(ValueError, match="0-d"):
        Batches(torch.tensor(1.0), batch_size=4)


# -- unshuffled: the same batches as DataLoader(TensorDataset) ----------------------------------
@pytest.mark.parametrize("n, size, drop_last", [(10, 4, False), (10, 4, True), (12, 4, False), (12, 4, True),
                                                 (3, 5, False), (3, 5, True), (1, 1, False)])
def test_unshuffled_equals_dataloader(n, size, drop_last):
    x, y = data(n)
    want = [tuple(b) for b in DataLoader(TensorDataset(x, y), batch_size=size, drop_last=drop_last)]
    batches = Batches(x, y, batch_size=size, drop_last=drop_last)
    assert len(batches) == len(want)
    assert_same(list(batches), want)


def test_a_single_tensor_gives_1_tuples_like_tensordataset():
    x, _ = data(5)
    got = list(Batches(x, batch_size=2))
    want = [tuple(b) for b in DataLoader(TensorDataset(x), batch_size=2)]
    assert all(len(b) == 1 for b in got)
    assert_same(got, want)


def test_unshuffled_batches_are_views_of_the_data():
    x, y = data(10)
    for bx, by in Batches(x, y, batch_size=4):
        assert bx.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert by.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


# -- shuffled -----------------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_epoch_is_a_permutation_with_rows_kept_together(drop_last):
    x, y = data(11)
    batches = Batches(x, y, batch_size=4, shuffle=True, seed=3, drop_last=drop_last)
    got = list(batches)
    assert [len(b[0]) for b in got] == ([4, 4] if drop_last else [4, 4, 3])
    order = ids(got)
    assert len(set(order)) == len(order)
    assert set(order) <= set(range(11)) and (drop_last or sorted(order) == list(range(11)))
    assert order != sorted(order)
    for bx, by in got:  # x and y rows stay paired
        assert torch.equal(by, bx[:, 0].long() * 10)
        assert torch.equal(bx, x[bx[:, 0].long()])


def test_the_order_is_a_pure_function_of_seed_and_epoch():
    x, y = data(64)
    a = Batches(x, y, batch_size=8, shuffle=True, seed=5)
    b = Batches(x, y, batch_size=8, shuffle=True, seed=5)
    assert_same(list(a), list(a))  # the same epoch twice: the same batches
    assert_same(list(a), list(b))
    first = ids(a)
    a.set_epoch(1)
    second = ids(a)
    assert a.epoch == 1 and second != first
    b.set_epoch(7), b.set_epoch(1)  # the path to an epoch does not matter
    assert ids(b) == second
    a.set_epoch(0)
    assert ids(a) == first
    assert ids(Batches(x, y, batch_size=8, shuffle=True, seed=6)) != first


def test_epoch_seeds_do_not_collide_trivially():
    pairs = [(s, e) for s in range(-2, 30) for e in range(30)]
    assert len({epoch_seed(s, e) for s, e in pairs}) == len(pairs)
    assert all(0 <= epoch_seed(s, e) < 2**64 for s, e in pairs)


def test_the_global_rng_is_never_touched():
    x, y = data(50)
    before = torch.random.get_rng_state()
    batches = Batches(x, y, batch_size=8, shuffle=True, seed=1)
    for epoch in range(3):
        batches.set_epoch(epoch)
        list(batches), list(batches.iter_from(2)), list(batches.shard(1, 3))
    assert torch.equal(torch.random.get_rng_state(), before)


# -- iter_from ----------------------------------------------------------------------------------
@pytest.fixture(params=[1, 200, None], ids=["gather-1-batch", "gather-2-batches", "gather-default"])
def gather_bytes(request, monkeypatch):
    """Shuffled batches are gathered several at a time: check chunk boundaries too (a batch of
    4 rows here is 4 * (3 * 4 + 8) = 80 bytes)."""
    if request.param is not None:
        monkeypatch.setattr(hookfit.data, "_GATHER_BYTES", request.param)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iter_from_k_is_the_tail_of_the_epoch(shuffle, drop_last, gather_bytes):
    x, y = data(23)
    batches = Batches(x, y, batch_size=4, shuffle=shuffle, seed=2, drop_last=drop_last)
    batches.set_epoch(3)
    full = list(batches)
    for k in range(len(batches) + 1):
        assert_same(list(batches.iter_from(k)), full[k:])
    assert list(batches.iter_from(len(batches))) == []


def test_shuffled_batches_equal_per_batch_gathers(gather_bytes):
    x, y = data(23)
    order = torch.randperm(23, generator=torch.Generator().manual_seed(epoch_seed(8, 1)))
    want = [(x[i], y[i]) for i in order.split(5)]
    batches = Batches(x, y, batch_size=5, shuffle=True, seed=8)
    batches.set_epoch(1)
    assert_same(list(batches), want)


def test_iter_from_gathers_no_earlier_rows(monkeypatch, gather_bytes):
    x, y = data(40)
    batches = Batches(x, y, batch_size=4, shuffle=True)
    full = list(batches)
    gathered = []
    original = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda t, d, i: gathered.extend(i.tolist()) or original(t, d, i))
    assert_same(list(batches.iter_from(8)), full[8:])
    assert sorted(gathered) == sorted(ids(full[8:]) * 2)  # those rows of x and y, no others


@pytest.mark.bad_input
@pytest.mark.parametrize("start", [-1, 5, 100])
def test_iter_from_out_of_range_is_refused_at_once(start):
    batches = Batches(*data(10), batch_size=3)  # 4 batches
    with pytest.raises(ValueError, match=f"iter_from\\({start}\\)"):
        batches.iter_from(start)


# -- shards -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 7, 10, 11, 12])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_have_equal_lengths_and_cover_the_data(n, world_size, drop_last, shuffle):
    x, y = data(n)
    whole = Batches(x, y, batch_size=2, shuffle=shuffle, seed=4, drop_last=drop_last)
    whole.set_epoch(2)
    shards = [whole.shard(rank, world_size) for rank in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    per_rank = [ids(s) for s in shards]
    assert len({len(p) for p in per_rank}) == 1
    taken = [i for p in per_rank for i in p]
    if drop_last:  # whole batches of distinct samples, the remainder dropped
        assert len(taken) == len(set(taken)) == world_size * len(shards[0]) * 2
        assert set(taken) <= set(range(n))
    else:  # every sample, duplicates only as padding
        assert set(taken) == set(range(n))
        assert len(taken) == -(-n // world_size) * world_size


@pytest.mark.parametrize("n, world_size, drop_last", [(10, 3, False), (10, 3, True), (2, 3, False), (12, 3, False)])
def test_unshuffled_shards_equal_distributed_sampler(n, world_size, drop_last):
    x, y = data(n)
    whole = Batches(x, y, batch_size=2, drop_last=drop_last)
    ds = TensorDataset(x, y)
    for rank in range(world_size):
        sampler = DistributedSampler(ds, world_size, rank, shuffle=False, drop_last=drop_last)
        want = [tuple(b) for b in DataLoader(ds, batch_size=2, sampler=sampler, drop_last=drop_last)]
        assert_same(list(whole.shard(rank, world_size)), want)


def test_the_shuffle_is_global_then_split():
    x, y = data(12)
    whole = Batches(x, y, batch_size=12, shuffle=True, seed=9)
    whole.set_epoch(4)
    order = ids(whole)
    for rank in range(3):
        shard = whole.shard(rank, 3)
        assert shard.epoch == 4
        assert ids(shard) == order[rank::3]


@pytest.mark.bad_input
def test_shard_arguments_are_checked():
    batches = Batches(*data(10), batch_size=2)
    for rank, world_size in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match="shard"):
            batches.shard(rank, world_size)
    with pytest.raises(ValueError, match="already a shard"):
        batches.shard(0, 2).shard(0, 2)


# -- state --------------------------------------------------------------------------------------
def test_state_round_trips_through_torch_load_weights_only():
    x, y = data(30)
    batches = Batches(x, y, batch_size=4, shuffle=True, seed=11).shard(1, 2)
    batches.set_epoch(5)
    buffer = io.BytesIO()
    torch.save(batches.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state == {"seed": 11, "epoch": 5, "batch_size": 4, "shuffle": True, "drop_last": False,
                     "rank": 1, "world_size": 2, "num_samples": 30}
    resumed = Batches(x, y, batch_size=4, shuffle=True).shard(1, 2)  # seed 0
    resumed.set_epoch(5)
    list(resumed)  # seed 0's order of epoch 5 is drawn (and cached) before the load
    resumed.load_state_dict(state)
    assert (resumed.seed, resumed.epoch) == (11, 5)
    assert_same(list(resumed.iter_from(3)), list(batches)[3:])


@pytest.mark.parametrize("change, named", [
    ({"num_samples": 31}, "num_samples 31 saved, 30 here"),
    ({"batch_size": 8}, "batch_size 8 saved, 4 here"),
    ({"world_size": 3}, "world_size 3 saved, 2 here"),
    ({"shuffle": False}, "shuffle False saved, True here"),
])
@pytest.mark.bad_input
def test_load_state_dict_names_a_mismatch(change, named):
    batches = Batches(*data(30), batch_size=4, shuffle=True).shard(1, 2)
    state = {**batches.state_dict(), "seed": 3, "epoch": 2, **change}
    with pytest.raises(ValueError, match=named):
        batches.load_state_dict(state)
    assert (batches.seed, batches.epoch) == (0, 0)  # nothing restored


def test_a_state_saved_by_another_rank_loads_into_this_ranks_shard():
    """Under torchrun rank 0 saves the checkpoint and every rank loads it."""
    x, y = data(30)
    saved = Batches(x, y, batch_size=4, shuffle=True, seed=9).shard(0, 2)
    saved.set_epoch(3)
    mine = Batches(x, y, batch_size=4, shuffle=True).shard(1, 2)
    mine.load_state_dict(saved.state_dict())
    reference = Batches(x, y, batch_size=4, shuffle=True, seed=9).shard(1, 2)
    reference.set_epoch(3)
    assert (mine.seed, mine.epoch) == (9, 3)
    assert_same(list(mine), list(reference))


def test_a_state_of_another_world_size_loads_when_the_global_batch_is_the_same():
    """2 shards of batch 4 resumed as 1 of batch 8 (and back): each step's batches are the same
    samples, the position carries over; another global batch is refused."""
    x, y = data(32)
    two = [Batches(x, y, batch_size=4, shuffle=True, seed=5).shard(r, 2) for r in (0, 1)]
    for shard in two:
        shard.set_epoch(2)
    one = Batches(x, y, batch_size=8, shuffle=True)
    one.load_state_dict(two[0].state_dict())
    assert (one.seed, one.epoch, len(one)) == (5, 2, len(two[0]))
    for k, whole in enumerate(one.iter_from(1), start=1):
        parts = [list(shard.iter_from(k))[0] for shard in two]
        assert sorted(whole[0][:, 0].tolist()) == sorted(torch.cat([p[0] for p in parts])[:, 0].tolist())
    back = Batches(x, y, batch_size=4, shuffle=True).shard(1, 2)
    back.load_state_dict(one.state_dict())
    assert (back.seed, back.epoch) == (5, 2)
    with pytest.raises(ValueError, match="for other batches: world_size 1 saved, 2 here$"):
        Batches(x, y, batch_size=8, shuffle=True).shard(0, 2).load_state_dict(one.state_dict())


@pytest.mark.bad_input
def test_load_state_dict_refuses_a_foreign_dict():
    with pytest.raises(ValueError, match="missing"):
        Batches(*data(4), batch_size=2).load_state_dict({"epoch": 1})


# -- devices ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_index_tensors_live_on_the_data_device(device):
    x = torch.empty(10, 3, device=device)
    y = torch.empty(10, device=device)
    for shuffle in (False, True):
        batches = Batches(x, y, batch_size=4, shuffle=shuffle)
        got = list(batches)
        assert [b[0].shape[0] for b in got] == [4, 4, 2]
        assert all(t.device.type == device for b in got for t in b)
        assert batches.shard(1, 3)._indices()[0].device.type == device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_equal_cpu_batches():
    x, y = data(33)
    cpu = Batches(x, y, batch_size=4, shuffle=True, seed=1)
    gpu = Batches(x.cuda(), y.cuda(), batch_size=4, shuffle=True, seed=1)
    assert_same([tuple(t.cpu() for t in b) for b in gpu], list(cpu))


def test_length_is_none_for_data_that_cannot_say_even_a_dataloader_whose_len_raises():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    from hookfit.data import length
    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)
    assert hasattr(loader, "__len__") and length(loader) is None
    assert length(x for x in []) is None and length([1, 2, 3]) == 3
    assert length(torch.utils.data.DataLoader(list(range(8)), batch_size=3)) == 3


def test_a_streaming_dataloader_trains_and_validates_with_the_default_stack(tmp_path, monkeypatch):
    """A DataLoader over an IterableDataset: every built-in asks ``hookfit.data.length``, none
    calls ``len()`` (which raises on it): the default stack trains and validates."""
    import hookfit

    monkeypatch.delenv("HOOKFIT_PLUGINS")  # the discovered plugins, as a user's script has them

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(0)
            for _ in range(20):
                yield torch.randn(2, generator=generator), torch.randn(1, generator=generator)

    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loop.backward(loss)
        return {"loss": loss}

    loop = hookfit.Loop(step, torch.utils.data.DataLoader(Stream(), batch_size=4), model=model,
                        val_step=lambda loop, batch: {"loss": torch.nn.functional.mse_loss(model(batch[0]), batch[1])},
                        val_data=torch.utils.data.DataLoader(Stream(), batch_size=4),
                        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2, run_dir=tmp_path)
    loop.fit()
    assert (loop.state.status, loop.state.step) == ("completed", 10)


@pytest.mark.bad_input
@pytest.mark.parametrize("val_data, named", [
    ([], "val_data"),
    (torch.utils.data.DataLoader(list(range(5)), batch_size=8, drop_last=True), "val_data"),
    ({"clean": [1, 2], "noisy": []}, "val_data['noisy']"),
])
def test_an_empty_validation_set_is_refused_when_the_loop_is_built_before_an_epoch_trains(val_data, named) -> None:
    """It failed the run only at the first validation, after a whole epoch of training, before that epoch's
    checkpoint: the epoch was lost; an empty set of several was skipped without a word."""
    trained = []

    def step(loop, batch):
        trained.append(batch)

    with pytest.raises(ValueError, match=re.escape(f"{named} is empty (len() is 0; a DataLoader with drop_last=True")):
        hookfit.Loop(step, [1, 2, 3], val_step=step, val_data=val_data).fit()
    assert trained == []
