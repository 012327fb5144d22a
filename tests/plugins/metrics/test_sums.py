"""Sums, ``Metrics(sums=("nll_sum", "ntok"))``: step outputs added up over a stage's batches (every
process's), reset each stage as means are, kept across a resume, seen by derived metrics (the corpus
perplexity), and checked: the option when the plugin is built, a summed key's values at the batch
that returns them, a name no step returns at the end of the run's stages."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from conftest import StopAfter
from hookfit.data import Batches
from hookfit.errors import HookfitWarning
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.checkpoint.storage import read
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim

VOCAB, PAD = 16, 0
PPL = {"ppl": lambda m: math.exp(m["nll_sum"] / m["ntok"])}


def corpus(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` sequences of 3 to 20 tokens (1..VOCAB-1): lengths that differ, so a mean per sequence
    is not a mean per token."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(3, 21, (1,), generator=g)),), generator=g) for _ in range(n)]


def batches(seqs: list[torch.Tensor], size: int) -> list[torch.Tensor]:
    """Padded batches of ``size`` sequences (the last one shorter)."""
    return [torch.nn.utils.rnn.pad_sequence(seqs[i:i + size], batch_first=True, padding_value=PAD)
            for i in range(0, len(seqs), size)]


def lm_sums(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The batch's summed next-token NLL over its real tokens, and their number."""
    targets = ids[:, 1:]
    real = targets != PAD
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits[real], targets[real], reduction="sum"), int(real.sum())


class Snapshots:
    name = "snapshots"

    def __init__(self) -> None:
        self.updates: list[Any] = []
        self.epochs: list[Any] = []

    @hookfit.hookimpl
    def metrics_update(self, metrics: Any) -> None:
        self.updates.append(metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, metrics: Any) -> None:
        self.epochs.append(metrics)


def test_the_perplexity_of_summed_losses_and_token_counts_is_the_corpus_perplexity(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Embedding(VOCAB, VOCAB)  # a bigram model: its losses differ from sequence to sequence
    val = batches(corpus(100, 2), 32)  # 32, 32, 32 and 4 sequences
    seen, stream = Snapshots(), io.StringIO()

    def val_step(loop: Any, ids: torch.Tensor) -> dict[str, Any]:
        nll, ntok = lm_sums(loop.model, ids)
        return {"nll_sum": nll, "ntok": ntok}

    state = hookfit.Loop(val_step=val_step, val_data=val, model=model, run_dir=tmp_path / "run",
                         plugins=[Metrics(interval=0, sums=("nll_sum", "ntok"), derived=PPL), seen,
                                  Console(stream=stream), MetricsLog()]).validate()
    with torch.inference_mode():
        parts = [lm_sums(model, ids) for ids in val]
    nll, ntok = sum(float(s) for s, _ in parts), sum(n for _, n in parts)  # batch by batch, as the plugin adds
    metrics = state.results["metrics"]
    assert metrics["valid/nll_sum"] == nll and metrics["valid/ntok"] == ntok
    assert metrics["valid/ppl"] == pytest.approx(math.exp(nll / ntok), rel=1e-12)
    # each publication: the sum so far as the running value, the batch's own as the last
    running = [(u.values["nll_sum"].running, u.values["ntok"].running, u.values["ntok"].last) for u in seen.updates]
    so_far = [sum(float(s) for s, _ in parts[:i + 1]) for i in range(len(parts))]
    assert running == [(pytest.approx(so_far[i], rel=1e-12), sum(n for _, n in parts[:i + 1]), parts[i][1])
                       for i in range(len(parts))]
    assert seen.updates[-1].values["ppl"].running == pytest.approx(math.exp(nll / ntok), rel=1e-12)
    # a sum has no direction unless given one; the log and the console show the sums
    assert "valid/nll_sum" not in state.results["best"] and seen.epochs[-1].best == {}
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"event": "epoch"' in line]
    assert (row["nll_sum"], row["ntok"], row["ppl"]) == (nll, ntok, pytest.approx(math.exp(nll / ntok)))
    assert f"metric=ntok last={ntok}" in stream.getvalue()


def test_training_sums_restart_each_epoch_and_each_validation_set_sums_its_own() -> None:
    torch.manual_seed(0)
    model = torch.nn.Embedding(VOCAB, VOCAB)
    train = batches(corpus(50, 1), 8)  # 6 batches of 8 and one of 2
    sets = {"clean": batches(corpus(20, 2), 6), "noisy": batches(corpus(9, 3), 4)}
    given: dict[tuple[str, int], list[tuple[float, int]]] = {}

    def train_step(loop: Any, ids: torch.Tensor) -> dict[str, Any]:
        nll, ntok = lm_sums(loop.model, ids)
        loop.backward(nll / ntok)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        given.setdefault(("train", loop.state.epoch), []).append((float(nll.detach()), ntok))
        return {"loss": nll / ntok, "nll_sum": nll.detach(), "ntok": ntok}

    def val_step(loop: Any, ids: torch.Tensor) -> dict[str, Any]:
        nll, ntok = lm_sums(loop.model, ids)
        given.setdefault((loop.state.val_set, loop.state.epoch), []).append((float(nll), ntok))
        return {"nll_sum": nll, "ntok": ntok}

    seen = Snapshots()
    hookfit.Loop(train_step, train, val_step=val_step, val_data=sets, model=model, max_epochs=2,
                 optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
                 plugins=[Optim(), Metrics(sums=["nll_sum", "ntok"], derived=PPL), seen]).fit()
    for snapshot in seen.epochs:
        for prefix in ("",) if snapshot.stage == "train" else ("clean/", "noisy/"):
            parts = given[(prefix.rstrip("/") or "train", snapshot.epoch)]
            nll, ntok = sum(s for s, _ in parts), sum(n for _, n in parts)
            values = snapshot.values
            assert (values[prefix + "nll_sum"].epoch, values[prefix + "ntok"].epoch) == (nll, ntok)
            assert values[prefix + "ppl"].epoch == pytest.approx(math.exp(nll / ntok), rel=1e-12)
    assert len(seen.epochs) == 4 and seen.epochs[0].values["loss"].epoch != seen.epochs[0].values["ppl"].epoch


def resumable(run_dir: Path, *, stop: int | None = None, resume: str | None = None,
              sums: tuple[str, ...] = ("sse", "count")) -> dict[str, list[Any]]:
    """Two epochs of 7 training batches (the last of 2 samples) summing squared errors and counts, a
    checkpoint at each epoch's end and at a stop; the training history."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 4, generator=g), torch.randn(50, 1, generator=g)

    def step(loop: Any, batch: Any) -> dict[str, Any]:
        errors = (loop.model(batch[0]) - batch[1]) ** 2
        loop.backward(errors.mean())
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"sse": errors.sum(), "count": len(errors)}

    metrics = Metrics(sums=sums, derived={"mse": lambda m: m["sse"] / m["count"]})
    plugins: list[Any] = [Optim(), metrics, Checkpoint(every_n_epochs=1, background=False)]
    if stop:
        plugins.append(StopAfter(stop))
    hookfit.Loop(step, Batches(x, y, batch_size=8, shuffle=True, seed=3), model=model,
                 optimizers=torch.optim.SGD(model.parameters(), lr=0.05), max_epochs=2, run_dir=run_dir,
                 resume=resume, plugins=plugins).fit()
    return {k: [dict(e) for e in v] for k, v in metrics.history.items()}


def test_a_run_resumed_in_the_middle_of_an_epoch_sums_that_epoch_as_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = resumable(tmp_path / "whole")
    resumable(tmp_path / "cut", stop=10)  # inside the second epoch
    [saved] = (tmp_path / "cut" / "checkpoints").glob("*step000000010*")
    assert read(saved)["plugins"]["metrics"]["train_stage"]["batches"] == 3  # resumed from its third batch
    resumed = resumable(tmp_path / "cut", resume="latest")
    assert [e["count"] for e in whole["train"]] == [50, 50]
    assert resumed["train"] == whole["train"]  # sums, counts and the derived mse, bit for bit


@pytest.mark.bad_input
def test_a_resume_with_other_sums_says_which_keys_of_the_epoch_in_progress_mix_a_mean_and_a_sum(
        tmp_path: Path) -> None:
    resumable(tmp_path / "cut", stop=10)
    with pytest.warns(HookfitWarning, match=r"^metrics: the checkpoint's training epoch in progress aggregated "
                                            r"'count' as a sum, and this run's sums=\('sse',\) does otherwise"):
        resumable(tmp_path / "cut", resume="latest", sums=("sse",))


SUMMED = """
import json, sys, torch, hookfit
from hookfit.plugins.metrics import Metrics
g = torch.Generator().manual_seed(0)
x = torch.randn(70, 3, generator=g)
data = [x[i:i + 10] for i in range(0, 70, 10)]  # 7 batches: 4 on one process, 3 on the other
def step(loop, b):
    loop.backward(loop.model(b).sum() * 0)
    return {"s": b.sum(), "n": len(b)}
def val_step(loop, b):
    return {"s": b.sum(), "n": len(b)}
model = torch.nn.Linear(3, 1)
state = hookfit.Loop(step, data[:6], val_step=val_step, val_data=data, model=model,
                     optimizers=torch.optim.SGD(model.parameters(), lr=0.0), max_epochs=1,
                     plugins=[Metrics(sums=("s", "n"), derived={"mean": lambda m: m["s"] / m["n"]})]).fit()
sys.stdout.write("RESULT " + json.dumps([state.rank, state.results["metrics"]]) + "\\n")
sys.stdout.flush()
"""


@pytest.mark.slow
def test_with_two_processes_the_sums_are_over_both(tmp_path: Path) -> None:
    script = tmp_path / "summed.py"
    script.write_text(SUMMED)
    torchrun = Path(sys.executable).with_name("torchrun")
    launch = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKFIT_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                         "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", HOOKFIT_PLUGINS="distributed,optim,metrics")
    done = subprocess.run([*launch, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "localhost:0", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    results = dict(json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
                   if line.startswith("RESULT "))
    x = torch.randn(70, 3, generator=torch.Generator().manual_seed(0))
    expected = {"train/s": float(x[:60].sum()), "train/n": 60, "valid/s": float(x.sum()), "valid/n": 70}
    for rank in (0, 1):
        got = results[rank]
        assert {k: got[k] for k in expected} == {k: pytest.approx(v, abs=1e-4) for k, v in expected.items()}
        assert got["valid/mean"] == pytest.approx(float(x.sum()) / 70, abs=1e-6)


# -- bad input


@pytest.mark.bad_input
@pytest.mark.parametrize("sums, error, message", [
    ("nll_sum", TypeError, "metrics: sums must be a list of the names of step outputs to add up"),
    ({"nll_sum": "sum"}, TypeError, "metrics: sums must be a list of the names of step outputs to add up"),
    (["nll_sum", 3], TypeError, "metrics: sums must hold the names of step outputs ('nll_sum'), got the entry 3"),
    (["", "ntok"], ValueError, "metrics: sums must hold the names of step outputs ('nll_sum'), got the entry ''"),
    (("batch_size",), ValueError, "metrics: sums must name metrics: 'batch_size' is what a batch counts"),
    (("step",), ValueError, "metrics: sums must name no field of the history"),
])
def test_sums_is_checked_when_metrics_is_built(sums: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        Metrics(sums=sums)
    assert str(raised.value).startswith(message), raised.value


class Steps:
    """A training step that returns ``{"loss": 1.0, key: value}``, ``value`` from its third batch on
    (a number before it, when ``first`` is given)."""

    def __init__(self, key: str, value: Any, first: Any = None) -> None:
        self.key, self.value, self.first = key, value, first

    def train_step(self, loop: Any, batch: int) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": 1.0}
        if batch >= 2:
            out[self.key] = self.value
        elif self.first is not None:
            out[self.key] = self.first
        return out


@pytest.mark.bad_input
@pytest.mark.parametrize("value, first, what", [
    (torch.ones(3), None, r"a tensor of shape \(3,\)"),
    (torch.ones(3), torch.tensor(2.0), r"a tensor of shape \(3,\)"),  # after batches of one number
    ("many", None, "str 'many'"),
    (None, 1.0, "NoneType None"),
])
def test_a_summed_key_that_is_not_one_number_is_refused_at_the_batch_it_appears_in(
        tmp_path: Path, value: Any, first: Any, what: str) -> None:
    steps = Steps("nll_sum", value, first)
    loop = hookfit.Loop(steps.train_step, list(range(6)), run_dir=tmp_path, plugins=[Metrics(sums=("nll_sum",))])
    with pytest.raises(TypeError, match=rf"step function 'Steps.train_step' returned {what} under 'nll_sum', which "
                                        rf"metrics: sums adds up over the stage's batches"):
        loop.fit()
    assert loop.run.state.batch_idx == 2


@pytest.mark.bad_input
def test_a_metric_object_under_a_summed_key_is_refused_it_sums_itself(tmp_path: Path) -> None:
    from torchmetrics.aggregation import SumMetric

    steps = Steps("nll_sum", SumMetric())
    loop = hookfit.Loop(steps.train_step, list(range(6)), run_dir=tmp_path, plugins=[Metrics(sums=("nll_sum",))])
    with pytest.raises(ValueError, match=r"returned a metric object \(SumMetric\) under 'nll_sum', which metrics: "
                                         r"sums adds up: a metric object aggregates itself"):
        loop.fit()


@pytest.mark.bad_input
def test_a_name_no_step_returns_is_said_once_every_stage_ended_and_one_stage_s_name_is_not() -> None:
    def train_step(loop: Any, batch: int) -> dict[str, Any]:
        return {"loss": 1.0}

    def val_step(loop: Any, batch: int) -> dict[str, Any]:
        return {"ntok": 3}  # summed in validation only: no step misses it

    loop = hookfit.Loop(train_step, [0, 1], val_step=val_step, val_data=[0, 1], max_epochs=2,
                        plugins=[Metrics(sums=("ntok", "ntokens"))])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state = loop.fit()
    messages = [str(w.message) for w in said if issubclass(w.category, HookfitWarning) and "sums" in str(w.message)]
    assert messages == ["metrics: sums names 'ntokens', which no step returned (train and valid ended; the steps "
                        "returned 'loss', 'ntok'): nothing is summed under it"]
    assert {w.filename for w in said if "sums" in str(w.message)} == {__file__}
    assert state.results["metrics"]["valid/ntok"] == 6
