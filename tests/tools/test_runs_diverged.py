"""A run whose metric went NaN or infinite (a diverged trial of a sweep) reads as diverged in
``hookfit runs`` and ``hookfit compare``: its final value is the NaN or infinity the run ended
with, it ranks after the runs that did not diverge, its plot leaves the non-finite points out
and says so; never a healthy final value, never an error."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from hookfit.plugins.tui import TuiRenderer
from hookfit.tools import cli, runs

NAN, INF = float("nan"), float("inf")


def _run(folder: Path, valid: list[float], train: list[float] | None = None) -> Path:
    """A completed run's files as the core and the metrics log write them, one validation loss an
    epoch (``NaN`` and ``Infinity`` as ``json`` writes them), two steps an epoch."""
    folder.mkdir(parents=True)
    epochs = len(valid)
    (folder / "run.jsonl").write_text(
        json.dumps({"event": "run", "name": "sweep", "started": "2026-01-01T00:00:00+0000", "resume": None}) + "\n"
        + json.dumps({"event": "end", "status": "completed", "reason": "max_epochs reached", "duration": 1.0,
                      "epochs": epochs, "steps": 2 * epochs}) + "\n")
    lines = [{"event": "best", "metrics": {"train/loss": "min", "valid/loss": "min"}}]
    for epoch, value in enumerate(valid, 1):
        loss = train[epoch - 1] if train else 1.0 / epoch
        lines += [{"event": "epoch", "stage": "train", "epoch": epoch, "step": 2 * epoch, "loss": loss},
                  {"event": "epoch", "stage": "valid", "epoch": epoch, "step": 2 * epoch, "loss": value}]
    lines.append({"event": "end", "status": "completed", "epoch": epochs, "step": 2 * epochs, "time": 1.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def _compare(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["compare", *argv, "--width", "40", "--height", "4"], plugins=[TuiRenderer()])
    out, err = capsys.readouterr()
    return code, out, err


def _table(out: str) -> list[list[str]]:
    return [line.split() for line in out.split("#  RUN", 1)[1].splitlines()[1:] if re.match(r"^\d+ ", line)]


def test_compare_shows_a_diverged_run_as_diverged_and_ranks_it_last(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    healthy = _run(tmp_path / "runs" / "ok", [12.0, 11.0, 10.5])
    diverged = _run(tmp_path / "runs" / "nan", [10.01, NAN, NAN])  # best 10.01 < 10.5, then NaN
    code, out, err = _compare(capsys, str(diverged), str(healthy))
    assert code == 0, err
    rows = _table(out)
    assert [row[1] for row in rows] == [str(healthy), str(diverged)], out  # the diverged one last
    assert rows[0][5] == "10.5" and rows[1][5] == "nan", out  # its final is NaN, not 10.01
    assert f"2 {diverged}: valid/loss nan from epoch 2" in out and "not drawn" in out, out
    assert "×" in out.split("#  RUN")[0], out  # the plot marks where the values are not drawn


def test_compare_of_a_run_infinite_every_epoch_is_no_error(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    infinite = _run(tmp_path / "runs" / "inf", [INF, INF])
    code, out, err = _compare(capsys, str(infinite))
    assert code == 0, err
    assert "no run has" not in err
    assert _table(out)[0][5] == "inf", out
    assert f"1 {infinite}: valid/loss inf from epoch 1" in out, out
    # every training step skipped (a NaN loss every epoch): compared, NaN, not 'no train/loss'
    skipped = _run(tmp_path / "runs" / "skipped", [3.0, 3.0], train=[NAN, NAN])
    code, out, err = _compare(capsys, str(skipped), str(infinite), "--metric", "train/loss")
    assert code == 0, err
    assert "(no train/loss in" not in out and _table(out)[0][5] == "0.5" and _table(out)[1][5] == "nan", out


def test_runs_lists_the_final_value_of_a_diverged_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "runs" / "ok", [12.0, 11.0])
    diverged = _run(tmp_path / "runs" / "nan", [10.01, NAN, NAN])
    info = runs.load(diverged)
    assert info.best == ("valid/loss", 10.01, 1) and info.final is not None
    assert math.isnan(info.final[0]) and info.final[1] == 3
    assert info.diverged == 2
    assert cli.main(["runs", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "FINAL" in lines[0].split()
    assert "nan from epoch 2" in next(line for line in lines if "/nan" in line)
    assert "11 " in next(line for line in lines if "/ok" in line)
    assert cli.main(["runs", str(tmp_path / "runs"), "--json"]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    listed = {Path(r["folder"]).name: r for r in json.loads(capsys.readouterr().out, parse_constant=refuse)}
    assert listed["nan"]["final"] == {"metric": "valid/loss", "value": "nan", "epoch": 3, "partial": False}
    assert listed["nan"]["diverged"] == 2
    assert listed["ok"]["final"] == {"metric": "valid/loss", "value": 11.0, "epoch": 2, "partial": False} and listed["ok"]["diverged"] is None


def test_compare_of_a_folder_of_runs_compares_every_run_in_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``hookfit compare runs/sweep`` (a sweep's folder, or a run name with several runs) compares
    every training run under it, as ``hookfit runs`` lists them, not only the newest."""
    sweep = tmp_path / "runs" / "sweep"
    trials = [_run(sweep / f"t{i}", [3.0 - i, 2.0 - i / 2]) for i in range(3)]
    other = _run(tmp_path / "runs" / "other" / "t0", [5.0])
    code, out, err = _compare(capsys, str(sweep), str(other))
    assert code == 0, err
    assert sorted(row[1] for row in _table(out)) == sorted(map(str, [*trials, other])), out
    monkeypatch.chdir(tmp_path)
    code, out, err = _compare(capsys, "sweep")  # a run name under runs/
    assert code == 0, err
    assert sorted(row[1] for row in _table(out)) == sorted(str(Path("runs/sweep") / t.name) for t in trials), out
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"], plugins=[TuiRenderer()])
    assert "every training run" in " ".join(capsys.readouterr().out.split())


def test_every_curves_label_stays_visible_where_curves_end_on_one_cell() -> None:
    """Curves that end on the same cell each keep their label (the next free cell nearby), a label
    of two digits is written whole, and a curve with nothing finite to draw is labelled on the
    top row where it ended."""
    from hookfit.plugins.support.plot import text_plot

    same = [(0.0, 1.0, 1.0), (10.0, 2.0, 2.0)]
    curves: dict[str, list[tuple[float, float, float]]] = {str(i): same for i in range(1, 11)}
    curves["11"] = []  # NaN or infinite throughout
    plot = "\n".join(text_plot(curves, width=20, height=4, marks=True, undrawn={"11": 5.0}))
    drawn = "".join(line.split("│", 1)[1] for line in plot.split("└", 1)[0].splitlines() if "│" in line)
    for label in [str(i) for i in range(2, 10)] + ["10", "11"]:
        assert label in drawn, (label, plot)
    assert drawn.count("1") >= 4, plot  # 1, 10 and 11: four ones


def test_labels_beside_each_other_keep_a_cell_between_them() -> None:
    """Three curves ending on one cell of a plot two lines high: the third label goes left of the
    others, with a blank cell between, never read as one label ("31" for 3 and 1)."""
    from hookfit.plugins.support.plot import text_plot

    same = [(0.0, 1.0, 1.0), (10.0, 2.0, 2.0)]
    plot = text_plot({"1": same, "2": same, "3": same}, width=20, height=2, marks=True)
    rows = [line.split("│", 1)[1] for line in plot if "│" in line]
    assert all(label in "".join(rows) for label in "123"), plot
    assert not any(re.search(r"[0-9]{2}", row) for row in rows), plot


def test_compare_labels_a_run_with_no_finite_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    healthy = _run(tmp_path / "runs" / "ok", [3.0, 2.0])
    twin = _run(tmp_path / "runs" / "twin", [3.0, 2.0])  # ends on the same cell as ok
    infinite = _run(tmp_path / "runs" / "inf", [INF, INF])
    code, out, err = _compare(capsys, str(healthy), str(twin), str(infinite))
    assert code == 0, err
    cells = "".join(line.split("│", 1)[1] for line in out.split("└", 1)[0].splitlines() if "│" in line)
    assert all(label in cells for label in "123"), out  # (the y axis's labels left out)
