"""The console: every epoch's summary, progress every N batches and by time, directions from the
snapshots, partial epochs."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import hookfit
from hookfit.payloads import MetricsSnapshot, Value
from hookfit.plugins import console as console_module
from hookfit.plugins.console import Console
from hookfit.plugins.metrics import Metrics

PROGRESS = re.compile(r"^hookfit (train|valid) epoch=(\d+)/(\d+) batch=(\d+)(?:/(\d+))?(.*)$")


def fields(line: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)


def progress(lines: list[str]) -> list[tuple[str, int, int]]:
    """(stage, epoch, batch) of each progress line."""
    return [(m[1], int(m[2]), int(m[4])) for m in map(PROGRESS.match, lines) if m]


def fit(console: Console, *plugins: Any, n: int = 20, epochs: int = 3, val: int = 2, **loop: Any) -> list[str]:
    def step(run, batch):
        return {"loss": torch.tensor(float(batch + 10 * run.state.epoch))}

    stream = console.stream
    assert isinstance(stream, io.StringIO)
    if val:
        loop.update(val_step=step, val_data=list(range(val)))
    hookfit.Loop(step, list(range(n)), max_epochs=epochs, plugins=[*plugins, console], **loop).fit()
    return stream.getvalue().splitlines()


# -- every epoch summary ---------------------------------------------------------------------

def test_every_epoch_summary_is_printed_however_quickly_the_epochs_come() -> None:
    """Before: summaries within 2 s of the previous one were dropped (3 of 8 in a language
    model run); here 8 epochs take milliseconds, and all 16 summaries are there, in order."""
    lines = fit(Console(stream=io.StringIO()), Metrics(), epochs=8)
    summaries = [l.split()[1:4] for l in lines if " done " in l]
    assert summaries == [[stage, f"epoch={e}/8", "done"] for e in range(1, 9) for stage in ("train", "valid")]
    assert all(fields(l)["batches"] in ("20", "2") for l in lines if " done " in l)


@pytest.mark.bad_input
def test_summary_interval_is_no_option_and_is_refused_naming_the_options(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every epoch summary is printed: there is no option to drop some, and ``hookfit plugins``
    lists none; one given is refused, the file's naming the options (``interval`` and
    ``every_n_batches`` bound the progress lines)."""
    from hookfit.config import options_of

    assert "summary_interval" not in options_of(Console(), {})
    with pytest.raises(TypeError, match=r"summary_interval"):
        Console(summary_interval=2.0)  # type: ignore[call-arg]
    (tmp_path / "run.toml").write_text("[plugins.console]\nsummary_interval = 0\n")
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "run.toml"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "console")
    with pytest.raises(hookfit.config.ConfigError, match=r"run.toml \[plugins.console\]: plugin 'console' has no option "
                                                          r"'summary_interval'; its options are: .*interval, "
                                                          r"every_n_batches"):
        hookfit.Loop(lambda loop, batch: None, [1], run_dir=tmp_path / "run").fit()


# -- progress every N batches ----------------------------------------------------------------

def test_a_progress_line_every_n_training_batches_with_the_values_at_that_batch() -> None:
    """20 batches an epoch, N=7: batches 7 and 14 of each of 3 epochs, none in validation.
    The metrics plugin publishes every batch here, so the values are those of the batch."""
    lines = fit(Console(stream=io.StringIO(), interval=None, every_n_batches=7), Metrics(interval=0, window=3))
    assert progress(lines) == [("train", e, b) for e in (1, 2, 3) for b in (7, 14)]
    for line in lines:
        if PROGRESS.match(line):
            got = fields(line)
            epoch, batch = int(got["epoch"].split("/")[0]), int(got["batch"].split("/")[0])
            assert got["batch"] == f"{batch}/20" and "metrics_at_batch" not in got and "eta" in got
            # the running mean of the last 3 batches (0-based batch - 3 .. batch - 1) of this epoch
            assert float(got["loss"]) == pytest.approx(batch - 2 + 10 * (epoch - 1))
    assert not any("plugins=" in l and "console.batches" in l for l in lines)  # the helper is no participant


class Publish:
    """A metrics plugin of its own: publishes ``metrics_update`` after the given training
    batches only (counted from 1) of the given epochs (from 0), with ``loss`` = the batch's
    number."""

    name = "publish"

    def __init__(self, *at: int, epochs: tuple[int, ...] = (0, 1, 2)) -> None:
        self.at, self.epochs = at, epochs

    @hookfit.hookimpl
    def batch_end(self, loop, batch_idx):
        if loop.training and batch_idx + 1 in self.at and loop.state.epoch in self.epochs:
            published = snapshot(loop.state.epoch, batch_idx + 1, 20, loss=batch_idx + 1, max_epochs=loop.max_epochs)
            loop.hooks.metrics_update(loop, "train", published)


def snapshot(epoch: int, batches: int, total: int | None, stage: str = "train", final: bool = False,
             best: dict[str, str] | None = None, max_epochs: int = 3, **values: float) -> MetricsSnapshot:
    return MetricsSnapshot(stage=stage, epoch=epoch, max_epochs=max_epochs, step=batches, batches=batches, total=total,
                           samples=2 * batches, elapsed=0.5 * batches,
                           values={k: Value(v, v, v) for k, v in values.items()}, final=final, best=best or {})


def test_a_line_by_batch_says_when_its_values_are_of_an_earlier_batch() -> None:
    """Published at batches 5 and 15: the lines at 10 and 20 carry those snapshots' values and
    say so; the line at 5 is the snapshot's own batch; before any snapshot, the position only."""
    lines = fit(Console(stream=io.StringIO(), interval=None, every_n_batches=5), Publish(5, 15), epochs=1, val=0)
    train = [l for l in lines if PROGRESS.match(l)]
    assert train == [
        "hookfit train epoch=1/1 batch=5/20 samples_per_s=4.0 eta=0:00:08 loss=5",
        "hookfit train epoch=1/1 batch=10/20 samples_per_s=4.0 eta=0:00:05 metrics_at_batch=5 loss=5",
        "hookfit train epoch=1/1 batch=15/20 samples_per_s=4.0 eta=0:00:02 loss=15",
        "hookfit train epoch=1/1 batch=20/20 samples_per_s=4.0 eta=0:00:00 metrics_at_batch=15 loss=15",
    ]
    lines = fit(Console(stream=io.StringIO(), interval=None, every_n_batches=5), Publish(15, epochs=(0,)), epochs=2,
                val=0)
    # epoch 2 has no snapshot of its own: epoch 1's values are never shown as epoch 2's
    assert [l for l in lines if PROGRESS.match(l) and "loss=" not in l] == [
        "hookfit train epoch=1/2 batch=5/20", "hookfit train epoch=1/2 batch=10/20",
        "hookfit train epoch=2/2 batch=5/20", "hookfit train epoch=2/2 batch=10/20",
        "hookfit train epoch=2/2 batch=15/20", "hookfit train epoch=2/2 batch=20/20"]


def test_lines_by_time_and_by_batch_combine_and_never_repeat_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake clock advances 2 s a batch; interval=10, every_n_batches=8 (16 s): a line by time
    comes when 10 s passed since the last line of either kind, and the clock restarts at each
    line. With N=4 (8 s) no line by time is ever due. With interval=0, every batch has one
    line, never two."""
    now = [0.0]
    monkeypatch.setattr(console_module, "_clock", lambda: now[0])

    class Tick:
        name = "tick"

        @hookfit.hookimpl(tryfirst=True)
        def batch_end(self, loop):
            now[0] += 2.0 if loop.training else 0.0

    def batches(**console: Any) -> list[int]:
        now[0] = 0.0
        lines = fit(Console(stream=io.StringIO(), **console), Metrics(interval=0), Tick(), n=32, epochs=1,
                    val=0)
        return [b for _, _, b in progress(lines)]

    # t = 2 * batch: time lines at 5 (t=10), 13 (t=26, 10 s after the line at 8), 21, 29
    assert batches(interval=10, every_n_batches=8) == [5, 8, 13, 16, 21, 24, 29, 32]
    assert batches(interval=10, every_n_batches=4) == list(range(4, 33, 4))
    assert batches(interval=10) == [5, 10, 15, 20, 25, 30]  # by time alone, as before
    assert batches(interval=0, every_n_batches=3) == list(range(1, 33))


@pytest.mark.slow
def test_every_n_batches_from_hookfit_toml_in_a_real_script(tmp_path: Path) -> None:
    """The discovered console configured by the file next to the script, nothing in the code:
    exactly the lines at batches 6, 12, 18 of each epoch (23 batches, 2 epochs), on stdout."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch, hookfit
        model = torch.nn.Linear(3, 1)
        data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(23)]

        def step(loop, batch):
            loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
            loop.backward(loss)
            loop.optimizers.step()
            loop.optimizers.zero_grad()
            return {"loss": loss}

        hookfit.Loop(step, data, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                     max_epochs=2).fit()
    """))
    (tmp_path / "hookfit.toml").write_text("[plugins.console]\nevery_n_batches = 6\ninterval = 3600\n\n"
                                           "[plugins.metrics]\ninterval = 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**env, "HOOKFIT_PLUGINS": "console,metrics,optim"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert progress(lines) == [("train", e, b) for e in (1, 2) for b in (6, 12, 18)], done.stdout
    assert all(re.search(r" batch=\d+/23 samples_per_s=\S+ eta=\S+ loss=\S+$", l) for l in lines if PROGRESS.match(l))
    assert sum(" done batches=23 " in l for l in lines) == 2


@pytest.mark.bad_input
@pytest.mark.parametrize("value, shown", [(0, "0"), (-5, "-5"), (2.5, "2.5"), (True, "True"), ("10", "'10'")])
def test_a_bad_every_n_batches_is_refused_when_the_console_is_made(value: Any, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^console: every_n_batches must be a positive integer \(training "
                                         rf"batches between progress lines\) or None, got {re.escape(shown)}$"):
        Console(every_n_batches=value)


# -- directions and partial epochs, from snapshots built by hand ------------------------------

class Epochs:
    """Publishes the given ``epoch_metrics`` snapshots, one per training stage, in order."""

    name = "epochs"

    def __init__(self, *snapshots: MetricsSnapshot) -> None:
        self.snapshots = list(snapshots)

    @hookfit.hookimpl
    def stage_end(self, loop, stage):
        if self.snapshots and stage == self.snapshots[0].stage:
            published = self.snapshots.pop(0)
            loop.hooks.epoch_metrics(loop, published.stage, published)


def console_of(*snapshots: MetricsSnapshot, **console: Any) -> list[str]:
    out = io.StringIO()
    epochs = max(s.epoch for s in snapshots) + 1
    hookfit.Loop(lambda l, b: None, [0], max_epochs=epochs, plugins=[Epochs(*snapshots),
                                                                      Console(stream=out, **console)]).fit()
    return out.getvalue().splitlines()


def results(lines: list[str]) -> dict[str, str]:
    return {fields(l)["metric"]: l.split(" last=", 1)[1] for l in lines if l.startswith("hookfit result ")}


def test_the_snapshots_directions_are_the_default_and_the_consoles_own_best_wins() -> None:
    """acc 0.5, 0.9, 0.7 and loss 3, 1, 2 over three epochs; the snapshots say acc is best
    high and loss best low; ppl has no direction anywhere."""
    best = {"acc": "max", "loss": "min"}
    published = [snapshot(e, 20, 20, final=True, best=best, acc=a, loss=l, ppl=p)
                 for e, (a, l, p) in enumerate([(0.5, 3, 9), (0.9, 1, 4), (0.7, 2, 6)])]
    assert results(console_of(*published)) == {
        "acc": "0.7 best=0.9 best_epoch=2", "loss": "2 best=1 best_epoch=2",
        "ppl": "6 min=4 min_epoch=2 max=9 max_epoch=1"}
    # the console's own best wins for the names it lists (bare or "stage/metric"), only those
    got = results(console_of(*published, best={"train/loss": "max", "ppl": "min"}))
    assert got == {"acc": "0.7 best=0.9 best_epoch=2", "loss": "2 best=3 best_epoch=1", "ppl": "6 best=4 best_epoch=2"}
    # a console best for another stage leaves this one to the snapshots
    assert results(console_of(*published, best={"valid/loss": "max"}))["loss"] == "2 best=1 best_epoch=2"


def test_a_partial_epoch_summary_says_so_a_whole_one_does_not() -> None:
    lines = console_of(snapshot(0, 100, 100, final=True, loss=1.0), snapshot(1, 37, 100, final=True, loss=0.5),
                       snapshot(2, 37, None, final=True, loss=0.25))
    summaries = [l for l in lines if re.match(r"hookfit train epoch=", l)]
    assert [l.split(" time=")[0] for l in summaries] == [
        "hookfit train epoch=1/3 done batches=100",
        "hookfit train epoch=2/3 partial batches=37/100",  # a stop or max_steps inside the epoch
        "hookfit train epoch=3/3 done batches=37",  # no length: nothing says it was cut short
    ]
    assert "done" not in summaries[1] and summaries[1].endswith(" loss=0.5")


class Stream:
    """A hundred batches and no length, as a streaming dataset."""

    def __iter__(self):
        return iter(range(100))


@pytest.mark.parametrize("ended", ["max_steps", "a stop"])
def test_a_stage_of_data_without_a_length_cut_short_says_partial(ended: str) -> None:
    """max_steps=7 (or a stop after batch 7) of a stream: the summary comes once the run ended, not at the
    stage's end, and says partial; a stream read to its end says done."""
    from conftest import StopAfter

    def lines(**options) -> list[str]:
        out = io.StringIO()
        hookfit.Loop(lambda loop, b: {"loss": torch.tensor(float(b))}, Stream(), plugins=[Console(stream=out),
                     Metrics(), *options.pop("plugins", [])], **options).fit()
        return [l.split(" time=")[0] for l in out.getvalue().splitlines() if l.startswith("hookfit train epoch=")]

    cut = lines(max_steps=7) if ended == "max_steps" else lines(plugins=[StopAfter(7)])
    assert cut == [f"hookfit train epoch={'1' if ended == 'max_steps' else '1/1'} partial batches=7"]
    assert lines() == ["hookfit train epoch=1/1 done batches=100"]


def test_skipped_steps_are_counted_in_the_console_and_metrics_log_end_lines(tmp_path) -> None:
    """A run whose loss turned NaN skips most of its steps and ends "completed": the console's
    end lines and the metric log's end line count the skipped steps and say why."""
    import io
    import json

    import torch

    import hookfit
    from hookfit.plugins.console import Console
    from hookfit.plugins.metrics import Metrics
    from hookfit.plugins.metrics_log import MetricsLog
    from hookfit.plugins.optim import Optim

    model = torch.nn.Linear(2, 1)

    def step(loop, batch):
        loss = model(batch).mean() * (float("nan") if loop.state.step >= 3 else 1.0)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss}

    out = io.StringIO()
    with pytest.warns(Warning):  # optim warns of the skipped steps itself
        state = hookfit.Loop(step, [torch.ones(2, 2)] * 5, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                     max_epochs=2, run_dir=tmp_path, plugins=[Optim(nonfinite="skip"), Metrics(), MetricsLog(),
                                                              Console(stream=out)]).fit()
    skipped = [line for line in out.getvalue().splitlines() if line.startswith("hookfit skipped ")]
    assert len(skipped) == 1 and "steps=7 share=70%" in skipped[0] and "non-finite" in skipped[0]
    assert "most steps were skipped" in skipped[0]
    end = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and end["skipped"] == 7 and "non-finite" in end["skipped_reason"]
    # what fit() returns, and the run's record (run.jsonl), which keeps every plugin's results
    assert state.results["skipped_steps"] == 7 and "non-finite" in state.results["first_skip"]
    record = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()][-1]
    assert record["event"] == "end" and record["results"]["skipped_steps"] == 7
    assert record["results"]["metrics"]["train/loss"] != record["results"]["metrics"]["train/loss"]  # NaN


class _Stream:
    """Re-iterable batches without a length."""

    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize("data, epochs, by_steps", [
    (_Stream(), {}, True),              # no length: max_steps decides, the epochs are not known
    (list(range(10)), {}, True),        # 15 steps end the run inside its second epoch
    (list(range(10)), {"max_epochs": 1}, False),  # the one epoch ends it before 15 steps
])
def test_with_max_steps_the_epochs_are_counted_as_the_run_counts_them(data: Any, epochs: dict, by_steps: bool) -> None:
    stream = io.StringIO()
    hookfit.Loop(lambda run, batch: {"loss": 1.0}, data, max_steps=15, **epochs,
                 plugins=[Metrics(), Console(stream=stream)]).fit()
    lines = stream.getvalue().splitlines()
    start = fields(lines[0])
    assert start["max_steps"] == "15" and ("epochs" not in start) == by_steps, lines[0]
    done = [line for line in lines if line.startswith("hookfit train ") and " done " in line]
    assert done and all(("/" not in fields(line)["epoch"]) == by_steps for line in done), done


def test_a_validation_every_n_steps_says_after_which_step_it_ran() -> None:
    lines = fit(Console(stream=io.StringIO()), Metrics(), n=6, epochs=2, val_every_n_steps=4)
    done = [fields(line) for line in lines if line.startswith("hookfit valid epoch=")]
    assert [(d["epoch"], d["step"]) for d in done] == [("1/2", "4"), ("2/2", "8"), ("2/2", "12")], lines
    plain = fit(Console(stream=io.StringIO()), Metrics(), n=6, epochs=2)  # one validation an epoch: the epoch says which
    assert [("step" in fields(line)) for line in plain if line.startswith("hookfit valid epoch=")] == [False, False]


def _skipped_line(bad_batches: set[int], two: bool, accumulate: int, n: int, epochs: int = 1, bad_epoch: int = 0,
                  **loop: Any) -> str:
    """The console's ``hookfit skipped`` line of a run whose loss is NaN at ``bad_batches`` (epoch-wise indices),
    with one optimizer or two (``two``: one on the weight, one on the bias, each stepped every batch)."""
    import warnings

    from hookfit.plugins.optim import Optim

    model = torch.nn.Linear(2, 1)
    names = ("weight", "bias") if two else ("default",)
    opts = ({"weight": torch.optim.SGD([model.weight], lr=0.1), "bias": torch.optim.SGD([model.bias], lr=0.1)}
            if two else torch.optim.SGD(model.parameters(), lr=0.1))

    def step(loop, batch):
        bad = loop.state.batch_idx in bad_batches and loop.state.epoch == bad_epoch
        loss = model(batch).mean() * (float("nan") if bad else 1.0)
        loop.backward(loss)
        for name in names:
            loop.optimizers[name].step()
        for name in names:
            loop.optimizers[name].zero_grad()
        return {"loss": loss}

    out = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hookfit.Loop(step, [torch.ones(2, 2)] * n, model=model, optimizers=opts, max_epochs=epochs,
                     plugins=[Optim(accumulate=accumulate), Console(stream=out), *loop.pop("plugins", [])],
                     **{"run_dir": None, **loop}).fit()
    skipped = [line for line in out.getvalue().splitlines() if line.startswith("hookfit skipped ")]
    assert len(skipped) <= 1
    return skipped[0] if skipped else ""


def test_the_skipped_share_is_of_each_optimizers_steps_not_of_batches_times_optimizers() -> None:
    """Two optimizers, 6 of 20 batches NaN: each skipped 6 of its 20 steps (30 %), not 12 of 20 batches."""
    line = _skipped_line({1, 3, 5, 7, 9, 11}, two=True, accumulate=1, n=20)
    assert "steps=12 share=30% optimizer=weight" in line and "most steps were skipped" not in line


def test_the_skipped_share_counts_an_accumulation_window_as_one_step_and_alarms_when_most_were_skipped() -> None:
    """accumulate=8, 3 of 5 windows poisoned: 3 of 5 steps skipped (60 %), not 3 of 40 batches."""
    line = _skipped_line({2, 10, 20}, two=False, accumulate=8, n=40)
    assert "steps=3 share=60%" in line and "optimizer=" not in line
    assert 'message="most steps were skipped: the run barely trained"' in line


def test_a_resumed_runs_skipped_share_is_of_the_steps_it_attempted_itself(tmp_path) -> None:
    """A run resumed after a clean epoch of 10 steps skips 3 of its own 10: 30 %, not 3 of the 20 counted since
    the first run began."""
    from hookfit.plugins.checkpoint import Checkpoint

    assert _skipped_line(set(), two=False, accumulate=1, n=10, epochs=1, run_dir=tmp_path,
                         plugins=[Checkpoint()]) == ""
    line = _skipped_line({1, 3, 5}, two=False, accumulate=1, n=10, epochs=2, bad_epoch=1, run_dir=tmp_path,
                         resume="latest", plugins=[Checkpoint()])
    assert "steps=3 share=30%" in line
