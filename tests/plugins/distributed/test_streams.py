"""The check that training streams each process reads itself (``shard_data=False``, no length) run out at the
same batch (:mod:`hookfit.plugins.distributed.streams`), against an in-process store standing for the run's; the
whole job under ``torchrun`` is in ``test_job.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hookfit.plugins.distributed.streams import compare_ends


def _timeout() -> str:
    return "1 s (HOOKFIT_DIST_TIMEOUT or Distributed(timeout=...))"


def test_streams_that_ran_out_at_the_same_batch_go_on() -> None:
    store = dist.HashStore()
    store.set("train_end/0/1", "5")  # rank 1 said so first
    compare_ends(store, 0, 2, 0, 5, 10.0, _timeout)
    assert store.get("train_end/0/0") == b"5"  # for rank 1, which may still be waiting


@pytest.mark.bad_input
def test_streams_that_ran_out_at_different_batches_are_refused_naming_each_count() -> None:
    store = dist.HashStore()
    store.set("train_end/2/0", "6")
    store.set("train_end/2/2", "4")
    with pytest.raises(ValueError, match=r"^distributed: train_data, a stream each process reads itself "
                                         r"\(shard_data=False, no length\), gave the processes different numbers of "
                                         r"batches in epoch 3 \(rank 0: 6, rank 1: 4, rank 2: 4\); every process "
                                         r"must give as many batches an epoch: give each process an equal part"):
        compare_ends(store, 1, 3, 2, 4, 10.0, _timeout)


@pytest.mark.bad_input
def test_a_stream_that_ran_out_while_others_went_on_is_refused_naming_them() -> None:
    store = dist.HashStore()
    store.set("train_end/0/1", "3")  # rank 2 went on: it says nothing
    with pytest.raises(ValueError, match=r"^distributed: train_data, .* ran out on rank 0 after 3 batches in epoch "
                                         r"1, but rank\(s\) 2 had not run out 0.2 s later \(the collective timeout, "
                                         r"1 s \(HOOKFIT_DIST_TIMEOUT or Distributed\(timeout=\.\.\.\)\), less the time .*"
                                         r"\(batches run out: rank 0: 3, rank 1: 3\); every process must give"):
        compare_ends(store, 0, 3, 0, 3, 0.2, _timeout)


def test_a_collective_cut_by_a_peer_closing_its_group_is_named_as_one() -> None:
    """What gloo says on a rank in a collective when the rank that ran out closes the group: it names the peer
    that failed first (:func:`~hookfit.plugins.distributed.failures.report`), not itself."""
    from hookfit.plugins.distributed.failures import _collective_error

    assert _collective_error(RuntimeError("Application timeout caused pair closure"))
    assert not _collective_error(RuntimeError("shapes cannot be multiplied"))


def test_a_wait_another_rank_fails_during_ends_naming_that_rank_and_its_error() -> None:
    """Rank 1 failed after the epoch's last collective (its stream raising as it ran out): it recorded its failure
    in the store and never says where its stream ended. Rank 0 stops waiting at once, well before ``seconds``,
    and its note names rank 1 and its error (:func:`~hookfit.plugins.distributed.failures.report`), not a count."""
    import json

    from hookfit.plugins.distributed.failures import FIRST_FAILURE, PeerFailed, report

    store = dist.HashStore()
    store.set(FIRST_FAILURE, json.dumps({"rank": 1, "world_size": 2, "failed": True,
                                         "error": "OSError: shard file truncated"}))
    with pytest.raises(PeerFailed, match=r"^distributed: rank 0 stopped waiting for the other ranks' training "
                                         r"streams to run out in epoch 2 \(its own ran out after 3 batches\): "
                                         r"another rank failed$") as caught:
        compare_ends(store, 0, 2, 1, 3, 600.0, _timeout)
    report(caught.value, 0, 2, store, _timeout, streams_apart=True)
    assert caught.value.__notes__ == [
        "hookfit distributed: a wait for the other ranks failed on rank 0 of 2 because rank 1 of 2 failed first: "
        "OSError: shard file truncated; collectives time out after 1 s (HOOKFIT_DIST_TIMEOUT or "
        "Distributed(timeout=...))"]  # (no note blaming the streams: the cause is known)


def test_a_count_that_arrives_as_the_wait_times_out_is_compared() -> None:
    """The store's wait timed out, but every rank's count is there when the ranks that did not say are looked
    for (the last came in between): the counts are compared, not the store's timeout raised."""

    class Late:  # a store whose waits time out, with every count already in it
        def __init__(self) -> None:
            self.store = dist.HashStore()

        def wait(self, keys: list[str], timeout: object) -> None:
            raise RuntimeError("Wait timeout")  # (what torch.distributed.DistStoreError says)

        def __getattr__(self, name: str) -> object:
            return getattr(self.store, name)

    late = Late()
    late.store.set("train_end/0/1", "3")
    compare_ends(late, 0, 2, 0, 3, 0.2, _timeout)  # type: ignore[arg-type]
    late.store.set("train_end/1/1", "4")
    with pytest.raises(ValueError, match=r"different numbers of batches in epoch 2 \(rank 0: 3, rank 1: 4\)"):
        compare_ends(late, 0, 2, 1, 3, 0.2, _timeout)  # type: ignore[arg-type]
