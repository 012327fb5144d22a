"""The checkpoint plugin's side of a run's results: ``"best_checkpoint"`` and
``"last_checkpoint"`` in ``fit().results``, known on every process under ``torchrun``; and
the best checkpoint evaluated by a test ``Loop`` built without optimizers, labelled with the
epoch it was saved at everywhere a person reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TESTS

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.metrics_log import MetricsLog
from hookfit.plugins.optim import Optim

SCRIPT = TESTS / "scripts" / "results_ddp.py"


def data() -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 3, generator=g), torch.randn(48, 1, generator=g)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)]
    return batches[:4], batches[4:]


def train(loop: Any, batch: Any) -> Any:
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def valid(loop: Any, batch: Any) -> Any:
    return {"loss": torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])}


class Losses:
    name = "losses"

    def __init__(self) -> None:
        self.valid: list[float] = []

    @hookfit.hookimpl
    def epoch_metrics(self, stage: str, metrics: Any) -> None:
        if stage == "valid":
            self.valid.append(metrics.values["loss"].epoch)


def fit(tmp_path: Path, checkpoint: Checkpoint, epochs: int = 4, lr: float = 0.1, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    batches, held_out = data()
    losses = Losses()
    state = hookfit.Loop(train, batches, val_step=valid, val_data=held_out, model=model,
                         optimizers=torch.optim.SGD(model.parameters(), lr=lr), max_epochs=epochs,
                         run_dir=tmp_path / "run", plugins=[Optim(), Metrics(), checkpoint, losses], **kwargs).fit()
    return state, losses.valid, model


def test_fit_returns_the_best_and_the_last_checkpoint(tmp_path: Path) -> None:
    checkpoint = Checkpoint(monitor="valid/loss", keep_last=1, background=False)
    state, losses, _ = fit(tmp_path, checkpoint)  # the validation loss falls, then rises
    folder = tmp_path / "run" / "checkpoints"
    best = losses.index(min(losses)) + 1
    assert best == 2  # the best is neither the first nor the last: both it and the last are kept
    assert state.results["best_checkpoint"] == folder / f"epoch{best:04d}-step{4 * best:09d}.pt"
    assert state.results["last_checkpoint"] == folder / "epoch0004-step000000016.pt"
    assert sorted(folder.iterdir()) == sorted({state.results["best_checkpoint"], state.results["last_checkpoint"]})
    assert checkpoint.best is not None and checkpoint.best[1] == state.results["best_checkpoint"]


def test_without_a_monitor_there_is_no_best_and_a_run_that_saved_nothing_has_no_last(tmp_path: Path) -> None:
    state, _, _ = fit(tmp_path, Checkpoint(background=False), epochs=1)
    assert state.results["best_checkpoint"] is None
    assert state.results["last_checkpoint"] == tmp_path / "run" / "checkpoints" / "epoch0001-step000000004.pt"
    state, _, _ = fit(tmp_path / "none", Checkpoint(every_n_epochs=None, on_interrupt=False), epochs=1)
    assert state.results["best_checkpoint"] is None and state.results["last_checkpoint"] is None


def test_a_stopped_run_s_last_checkpoint_is_the_one_it_wrote_at_the_stop(tmp_path: Path) -> None:
    from conftest import StopAfter

    checkpoint = Checkpoint(background=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    batches, _ = data()
    state = hookfit.Loop(train, batches, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                         max_epochs=3, run_dir=tmp_path / "run", plugins=[Optim(), checkpoint, StopAfter(6)]).fit()
    assert state.status == "interrupted"
    assert state.results["last_checkpoint"] == tmp_path / "run" / "checkpoints" / "epoch0002-step000000006.pt"
    # resumed and validated: the plugin knows the file it read
    test = hookfit.Loop(train, batches, val_step=valid, val_data=batches, model=torch.nn.Linear(3, 1),
                        plugins=[Optim(), Checkpoint()])
    assert test.validate(resume=state.results["last_checkpoint"]).results["last_checkpoint"] == (
        state.results["last_checkpoint"])


def test_the_best_checkpoint_is_evaluated_by_a_test_loop_without_optimizers_labelled_as_saved(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The end of epoch 1 is ``epoch0001-...``: validating it says epoch 1 in the state, on the
    console, in metrics.jsonl and in run.jsonl (it said epoch 2, the epoch a training run
    would continue in)."""
    checkpoint = Checkpoint(monitor="valid/loss", keep_last=1, background=False)
    state, losses, _ = fit(tmp_path, checkpoint, epochs=3, lr=0.3)
    best = state.results["best_checkpoint"]
    assert best.name == "epoch0001-step000000004.pt" and losses.index(min(losses)) == 0
    capsys.readouterr()

    model = torch.nn.Linear(3, 1)
    _, held_out = data()
    test = hookfit.Loop(train, data()[0], val_step=valid, val_data=held_out, model=model, run_dir=tmp_path / "test",
                        plugins=[Optim(), Metrics(), MetricsLog(), Console(), Checkpoint(), Losses()])
    tested = test.validate(resume=best)
    assert (tested.status, tested.epoch, tested.step) == ("completed", 0, 4)
    saved = torch.load(best, weights_only=True)["model"]
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    assert tested.results["metrics"]["valid/loss"] == pytest.approx(losses[0])  # the metrics plugin's answer

    out = capsys.readouterr().out.splitlines()
    resumed = [line for line in out if line.startswith("hookfit resumed ")]
    assert len(resumed) == 1 and " epoch=1 " in resumed[0], out
    assert [line for line in out if line.startswith("hookfit valid epoch=1 done ")], out  # no total: none trained
    end = [line for line in out if line.startswith("hookfit end ")]
    assert len(end) == 1 and " epochs=1 " in end[0], out
    rows = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()]
    assert {row["epoch"] for row in rows if "epoch" in row} == {1}, rows
    ended = [json.loads(line) for line in (tmp_path / "test" / "run.jsonl").read_text().splitlines()][-1]
    assert (ended["event"], ended["epochs"]) == ("end", 1)


def test_a_checkpoint_inside_an_epoch_is_validated_as_that_epoch(tmp_path: Path) -> None:
    checkpoint = Checkpoint(every_n_steps=6, every_n_epochs=None, background=False)
    fit(tmp_path, checkpoint, epochs=2)
    inside = tmp_path / "run" / "checkpoints" / "epoch0002-step000000006.pt"
    assert inside.exists()
    _, held_out = data()
    tested = hookfit.Loop(train, data()[0], val_step=valid, val_data=held_out, model=torch.nn.Linear(3, 1),
                          plugins=[Optim(), Checkpoint()]).validate(resume=inside)
    assert tested.epoch == 1 and tested.resumed_from.epoch == 1 and tested.resumed_from.batch == 2


def test_an_evaluation_reads_no_training_data_whatever_the_checkpoints_position(tmp_path: Path) -> None:
    """Inside an epoch (after 2 of its 4 batches) or at its end: an evaluation Loop with no
    training batches, or fewer than the checkpoint's epoch had, validates it, and says where
    its weights were made the same way whatever its training data (it reads none)."""
    fit(tmp_path, Checkpoint(every_n_steps=6, keep_last=5, background=False), epochs=2)
    _, held_out = data()
    for name, where in [("epoch0002-step000000006.pt", (1, 6, 2, "train")), ("epoch0001-step000000004.pt",
                                                                             (0, 4, 0, "valid"))]:
        seen = []
        for train_data in ([], data()[0][:1], data()[0]):
            tested = hookfit.Loop(train, train_data, val_step=valid, val_data=held_out, model=torch.nn.Linear(3, 1),
                                  plugins=[Metrics(), Checkpoint()]).validate(
                resume=tmp_path / "run" / "checkpoints" / name)
            info = tested.resumed_from
            seen.append(((info.epoch, info.step, info.batch, info.stage), tested.results["metrics"]))
        assert [at for at, _ in seen] == [where] * 3, name
        assert seen[0][1] == seen[1][1] == seen[2][1], name


def torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``results_ddp.py`` with ``args`` under ``torchrun --nproc-per-node 2``, in ``tmp_path``."""
    script = Path(sys.executable).with_name("torchrun")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    launch = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "HOOKFIT_DISABLE_PLUGINS")}
    env.update(OMP_NUM_THREADS="1", HOOKFIT_PLUGINS="")
    return subprocess.run([*launcher, *launch, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.slow
def test_every_process_knows_the_best_checkpoint_under_torchrun(tmp_path: Path) -> None:
    """Only rank 0 writes, in a run folder only it makes (``runs/results/<date>-<time>``);
    the epoch metrics are the same on every rank, so each names the same best file, and the
    same last one."""
    run = torchrun(tmp_path, "out")
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert ranks[0]["valid"] == ranks[1]["valid"] and len(ranks[0]["valid"]) == 3
    folders = list((tmp_path / "runs" / "results").iterdir())
    assert len(folders) == 1, folders  # rank 1 made no folder of its own
    best = str(folders[0].relative_to(tmp_path) / "checkpoints" / "epoch0001-step000000004.pt")
    last = str(folders[0].relative_to(tmp_path) / "checkpoints" / "epoch0003-step000000012.pt")
    for rank in ranks:
        assert Path(rank["results"]["best_checkpoint"]).resolve() == (tmp_path / best).resolve(), rank
        assert Path(rank["results"]["last_checkpoint"]).resolve() == (tmp_path / last).resolve(), rank
        assert rank["best"][0] == max(rank["valid"]) and rank["exist"] == {"best_checkpoint": True,
                                                                          "last_checkpoint": True}
    assert ranks[0]["results"] == ranks[1]["results"] and ranks[0]["best"] == ranks[1]["best"]


@pytest.mark.slow
def test_every_process_names_the_checkpoints_with_the_main_processs_tag_under_torchrun(tmp_path: Path) -> None:
    """``Checkpoint(dir="ck")``, the other process working in ``apart/``: the main process's folder ``ck`` (a
    relative path) is another folder there, as on a node that does not share the main process's filesystem, and it
    holds a checkpoint of tag 3, the main process's none. Each process worked out the tag of the run's names from
    its own listing: during the run the other process took epoch 1's checkpoint for ``ck/...-v4.pt``, a file no
    process wrote. Every process takes the main process's tag (0) and knows the file the main process wrote."""
    elsewhere = tmp_path / "apart" / "ck" / "epoch0001-step000000004-v3.pt"
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_bytes(b"a checkpoint the main process does not see")
    run = torchrun(tmp_path, "--apart", "out")
    assert run.returncode == 0, run.stdout + run.stderr
    main, other = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert main["status"] == other["status"] == "completed", (main, other)
    written = sorted(p.name for p in (tmp_path / "ck").glob("*.pt"))
    assert written == ["epoch0001-step000000008.pt", "epoch0002-step000000016.pt"], written
    assert main["seen"] == [str(tmp_path / "ck" / written[0])], main
    assert [Path(seen).name for seen in other["seen"]] == [written[0]], other  # (in ck/ of its own working folder)
    assert main["last"] == str(tmp_path / "ck" / written[1]) and other["last"] == main["last"], (main, other)


@pytest.mark.parametrize(("direction", "keep"), [("min", 1), ("max", 1), ("max", 2)])
def test_a_run_resumed_from_its_best_checkpoint_keeps_it_as_the_best(tmp_path: Path, direction: str, keep: int) -> None:
    """A run killed right after it wrote its best checkpoint (epoch 2; ``keep_last=1`` had pruned
    epoch 1's): that file's own state named the best before it, now gone. The resumed run takes
    the checkpoint it resumed from as the best by its own score, so epoch 3's worse score is not
    the best, and keep_last does not prune the best weights away. ``max`` follows the direction
    the metrics plugin publishes (Metrics(best=...)), which the resumed run knows before its
    first validation: with ``keep_last=2`` epoch 1's file, named the best in epoch 2's state, is
    still there, and only that direction says epoch 2's is better."""
    scores = {0: 3.0, 1: 1.0, 2: 2.0, 3: 2.5} if direction == "min" else {0: 1.0, 1: 3.0, 2: 2.0, 3: 1.5}
    m = torch.nn.Linear(3, 1)

    def scored(loop: Any, batch: Any) -> Any:
        return {"score": torch.tensor(scores[loop.state.epoch])}

    class Killed(Exception):
        pass

    class Kill:
        name = "kill"

        @hookfit.hookimpl(trylast=True)  # after the checkpoint's save of epoch 2
        def after_epoch(self, epoch: int) -> None:
            if epoch == 1:
                raise Killed

    def run(*more: Any, **options: Any) -> Any:
        train_data, valid_data = data()
        return hookfit.Loop(train, train_data, val_step=scored, val_data=valid_data, model=m,
                            optimizers=torch.optim.SGD(m.parameters(), lr=0.1), max_epochs=4, run_dir=tmp_path,
                            plugins=[Optim(), Metrics(best={"valid/score": direction}),
                                     Checkpoint(keep_last=keep, monitor="valid/score", background=False), *more],
                            **options).fit()

    with pytest.raises(Killed):
        run(Kill())
    first, second = (tmp_path / "checkpoints" / f"epoch000{e}-step00000000{4 * e}.pt" for e in (1, 2))
    assert sorted((tmp_path / "checkpoints").glob("epoch*.pt")) == [first, second][2 - keep:]
    state = run(resume="latest")
    assert state.results["best_checkpoint"] == second and second.exists()


@pytest.mark.slow
@pytest.mark.fault
def test_every_process_has_the_main_processs_checkpoint_results_when_its_writes_fail(tmp_path: Path) -> None:
    """DDP, one-file checkpoints every 2 of 8 steps: the main process's writes of steps 2 and 8
    fail (the last while the run ends). Every process's results are the main one's: 2 failed
    saves, the last checkpoint step 6's, a file that exists."""
    run = torchrun(tmp_path, "--failing", "out")
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["status"], r["step"]) for r in ranks] == [("completed", 8)] * 2
    last = tmp_path / "run" / "checkpoints" / "epoch0001-step000000006.pt"
    for rank in ranks:
        assert rank["results"] == {"best_checkpoint": None, "last_checkpoint": str(last), "failed_saves": 2,
                                   "skipped_saves": 0}, ranks
        assert rank["saved"] == [str(tmp_path / "run" / "checkpoints" / f"epoch0001-step00000000{s}.pt")
                                 for s in (4, 6)], ranks
    assert last.exists()


@pytest.mark.slow
@pytest.mark.fault
def test_a_failed_write_of_a_monitored_checkpoint_leaves_the_processes_in_step(tmp_path: Path) -> None:
    """The main process's write at step 4 fails (a full disk, warned): its best differs from the
    other's, and at step 8 (the validation's save, then the epoch's) one process asked the others
    whether to write again while the other went on building the checkpoint: both waited until
    the processes' timeout. The epoch's save takes the main process's answer: not written again."""
    run = torchrun(tmp_path, "--failing-monitored", "out")
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["status"], r["step"]) for r in ranks] == [("completed", 8)] * 2
    assert ranks[0]["results"] == ranks[1]["results"] and ranks[0]["results"]["failed_saves"] == 1, ranks



@pytest.mark.slow
@pytest.mark.fault
def test_a_failed_write_of_the_best_leaves_the_processes_deciding_the_next_best_alike(tmp_path: Path) -> None:
    """Checkpoints of the best only: the main process's write of epoch 1's best fails, so its scores know no best
    while the other's took that file as the best; at epoch 2 the main process alone saved a 'best' (a collective)
    and both waited until the processes' timeout. Every process takes the main process's decision."""
    run = torchrun(tmp_path, "--failing-best", "out")
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"status": "completed", "step": 24}] * 2, ranks


@pytest.mark.slow
def test_every_seconds_under_torchrun_follows_the_main_processs_clock(tmp_path: Path) -> None:
    """``every_seconds``: each process judged by its own clock, and one whose clock ran ahead saved alone (a
    collective): both waited until the processes' timeout. The main process's clock decides for all."""
    run = torchrun(tmp_path, "--seconds", "out")
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["status"], r["step"]) for r in ranks] == [("completed", 8)] * 2, ranks
    # an hour not passed on the main process's clock: no timed save, only the end's (its last save is older)
    assert ranks[0]["saved"] == ranks[1]["saved"] == ["epoch0001-step000000008.pt"], ranks


@pytest.mark.slow
def test_an_epochs_save_at_the_step_of_a_step_save_is_written_once_under_torchrun(tmp_path: Path) -> None:
    """Steps 8 and 16 end the epochs and are saved by ``every_n_steps=4`` too: each checkpoint is
    written and announced once (FSDP2 stalls every process for a second to build one), and the
    process that writes nothing announces none."""
    run = torchrun(tmp_path, "--repeat", "out")
    assert run.returncode == 0, run.stdout + run.stderr
    main, other = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    names = [f"epoch000{1 + (s - 1) // 8}-step0000000{s:02d}.pt" for s in (4, 8, 12, 16)]
    assert main["status"] == other["status"] == "completed"
    assert main["writes"] == names and other["writes"] == [], (main, other)
    assert [a[0] for a in main["announced"]] == names and other["announced"] == [], (main, other)


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("mode", ["--raising", "--raising-foreground"])
def test_with_on_save_error_raise_a_failed_write_of_the_main_process_at_the_end_fails_every_process(
        tmp_path: Path, mode: str) -> None:
    """DDP, ``max_steps=7``: the main process's write of the run's last checkpoint fails (a full disk) and
    ``on_save_error="raise"`` raises it there; the other process, which writes nothing, went on to the run's end
    alone and failed on gloo's closed connection (under NCCL it waits for its timeout). It fails with the main
    process's error named."""
    run = torchrun(tmp_path, mode, "out")
    assert run.returncode == 0, run.stdout + run.stderr  # (each process writes the error it ended with)
    main, other = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert main["status"] == other["status"] == "failed", (main, other)
    assert main["error"].startswith("OSError: [Errno 28] No space left on device"), main
    assert other["error"] == (
        "CheckpointError: checkpoint: the main process's checkpoint plugin failed as the run ended "
        "(OSError: [Errno 28] No space left on device: 'run/checkpoints/epoch0001-step000000007.pt'); every "
        "process of the run fails with it"), other


@pytest.mark.slow
@pytest.mark.bad_input
@pytest.mark.parametrize("mode", ["--one-rank", "--one-rank-alone"])
def test_a_checkpoint_given_to_the_main_process_alone_is_refused_on_every_process(tmp_path: Path, mode: str) -> None:
    """``Checkpoint(every_n_steps=2)`` given on rank 0 only, as a hand loop saves there only: the main process
    broadcast its folder to processes that never asked, or saved alone (a collective), and the job hung until the
    processes' timeout. Every process refuses the run before training, naming what differs: the options where
    the other process has the discovered checkpoint, the plugin where it has none; an earlier run's checkpoint
    in the folder is left as it was (not moved aside by a run refused)."""
    earlier = tmp_path / "run" / "checkpoints" / "epoch0001-step000000004.pt"
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"an earlier run's")
    run = torchrun(tmp_path, mode, "out")
    assert run.returncode == 0, run.stdout + run.stderr  # (each process writes the error it ended with)
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in ranks] == ["failed", "failed"], ranks
    if mode == "--one-rank":
        expected = ("ValueError: checkpoint: the processes were given different checkpoint options (every_n_steps=2 on the main process, None on rank 1; "
                    "on_failure=True on the main process, False on rank 1; background=False on the main process, "
                    "True on rank 1): give every process the same Checkpoint(...), not the main process alone")
    else:
        expected = ("ValueError: distributed: the processes run different plugins ('checkpoint' on rank 0 only); give "
                    "every process the same plugins (observers aside: a plugin that only watches, a logger of yours, "
                    "says observer = True in its class)")
    assert ranks[0]["error"].startswith(expected) and ranks[1]["error"].startswith(expected), ranks
    assert [p.name for p in (tmp_path / "run").glob("**/*.pt")] == [earlier.name], "nothing trained, nothing saved"
    assert earlier.read_bytes() == b"an earlier run's" and not (earlier.parent / "earlier-run-1").exists()  # not moved
