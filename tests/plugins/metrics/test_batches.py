"""The batch size a step's output does not give is inferred from the batch, the first dimension of its first
tensor; a batch that shows other first dimensions one level in (a sequence batch in the ``(T, B, F)`` layout
beside its targets, flat ids beside per-row offsets, a list of names beside a tensor that is not per-sample) gets
one ``MetricsWarning`` a step function and stage, at the stage's first batch, naming the size taken, where from,
the other first dimensions and the fix. Correct batches say nothing, and batches after a stage's first are not
looked at."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import hookfit
from hookfit.payloads import MetricsSnapshot
from hookfit.plugins.metrics import Metrics, MetricsWarning, batches

class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.epochs: list[MetricsSnapshot] = []

    @hookfit.hookimpl
    def epoch_metrics(self, metrics: MetricsSnapshot) -> None:
        self.epochs.append(metrics)


def run(step: Any, data: list[Any], tmp_path: Path, *, val_step: Any = None, val_data: Any = None,
        epochs: int = 1) -> tuple[list[warnings.WarningMessage], Collect]:
    """A run of ``step`` over ``data`` (and ``val_step`` over ``val_data``) with every warning recorded."""
    collect = Collect()
    loop = hookfit.Loop(step, data, val_step=val_step, val_data=val_data, max_epochs=epochs, run_dir=tmp_path,
                        plugins=[Metrics(), collect])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit()
    return caught, collect


def said(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MetricsWarning)]


def recsys(rows: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """An EmbeddingBag batch: every row's item ids in one flat tensor, each row's offset into it, a label a row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (rows,), generator=g)
    return {"ids": torch.randint(0, 50, (int(lengths.sum()),), generator=g),
            "offsets": torch.cumsum(lengths, 0) - lengths, "label": (torch.arange(rows) % 3 == 0).float()}


FIX = "if the batch holds another number of samples, return it: {'loss': loss, 'batch_size': len(batch%s)} " \
      "(README.md, 'A first script')"


@pytest.mark.bad_input
def test_flat_ids_beside_per_row_offsets_are_warned_of_once_at_the_first_batch_and_the_fix_weighs_by_rows(
        tmp_path: Path) -> None:
    """A recommender's batch, ``{"ids": (N,), "offsets": (B,), "label": (B,)}``: the inference takes N, the ids,
    so the epoch's click rate is weighed by the users' history lengths. One ``MetricsWarning``, pointing at the
    script, names the step function, the stage, N and ``['ids']``, B and where it is, and the fix; following the fix
    silences it and gives the true click rate."""
    data = [recsys(16, seed) for seed in range(3)] + [recsys(5, 3)]  # a last, smaller batch

    def val_step(loop, batch):
        return {"ctr": batch["label"].mean()}

    caught, _ = run(lambda loop, batch: None, [0], tmp_path / "warned", val_step=val_step, val_data=data, epochs=2)
    name = ("test_flat_ids_beside_per_row_offsets_are_warned_of_once_at_the_first_batch_and_the_fix_weighs_"
            "by_rows.<locals>.val_step")
    n = len(data[0]["ids"])
    assert said(caught) == [
        f"metrics: step function {name!r} returns no 'batch_size', so the valid stage weighs each of its batches by "
        f"the batch size inferred from the batch: {n}, the first dimension of the batch's first tensor, at ['ids']; "
        f"but the batch shows other first dimensions: 16 at ['offsets'], ['label']. The means, samples and "
        f"samples_per_s count what the size taken counts; " + FIX % "['offsets']"]  # once in two epochs
    assert [w.filename for w in caught if issubclass(w.category, MetricsWarning)] == [__file__]
    assert issubclass(MetricsWarning, hookfit.HookfitWarning)

    def fixed(loop, batch):
        return {"ctr": batch["label"].mean(), "batch_size": len(batch["offsets"])}

    caught, collect = run(lambda loop, batch: None, [0], tmp_path / "fixed", val_step=fixed, val_data=data)
    assert said(caught) == []
    true = torch.cat([b["label"] for b in data]).mean().item()
    assert collect.epochs[-1].values["ctr"].epoch == pytest.approx(true)
    assert collect.epochs[-1].samples == 16 * 3 + 5


@pytest.mark.bad_input
def test_a_sequence_first_batch_is_warned_of_at_its_first_batch_before_the_second_runs(tmp_path: Path) -> None:
    """PyTorch's default RNN layout, ``(T, B, F)`` beside targets ``(B,)``: T is taken. The warning comes at the
    stage's first batch: made an error, it stops the run there."""
    data = [(torch.zeros(12, 32, 3), torch.zeros(32)), (torch.zeros(12, 4, 3), torch.zeros(4))]
    steps: list[int] = []

    def train_step(loop, batch):
        steps.append(loop.state.step)
        return {"loss": batch[1].mean()}

    caught, _ = run(train_step, data, tmp_path / "warned")
    assert len(said(caught)) == 1
    assert ("so the train stage weighs each of its batches by the batch size inferred from the batch: 12, the "
            "first dimension of the batch's first tensor, at [0]; but the batch shows other first dimensions: 32 at "
            "[1]. ") in said(caught)[0] and said(caught)[0].endswith(FIX % "[1]")
    steps.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MetricsWarning)
        with pytest.raises(MetricsWarning, match=r"^metrics: step function '.*train_step' returns no 'batch_size'"):
            hookfit.Loop(train_step, data, run_dir=tmp_path / "error", plugins=[Metrics()]).fit()
    assert steps == [0]


@pytest.mark.bad_input
def test_a_list_of_names_before_the_tensors_is_named_with_the_first_dimensions_it_shows(tmp_path: Path) -> None:
    """``(ids, x, y)`` with the series' names first: the inference skips the list and takes the ``(T, B, F)``
    tensor's T; the names' list and the targets show B. A list of names beside the one tensor, ``(ids, x)``, is
    enough to show it."""
    names = [f"s{i}" for i in range(32)]

    def step(loop, batch):
        return {"loss": batch[1].mean()}

    caught, _ = run(step, [(names, torch.zeros(12, 32, 3), torch.zeros(32))], tmp_path / "three")
    assert len(said(caught)) == 1 and ("12, the first dimension of the batch's first tensor, at [1]; but the batch "
                                       "shows other first dimensions: 32 at [0] (a list of str), [2]. ") in said(caught)[0]
    assert said(caught)[0].endswith(FIX % "[0]")
    caught, _ = run(step, [(tuple(names), torch.zeros(12, 32, 3))], tmp_path / "two")
    assert len(said(caught)) == 1 and "32 at [0] (a tuple of str)." in said(caught)[0]


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.bad_input
def test_a_0_d_first_tensor_and_a_dataclass_batch_whose_size_is_taken_as_1_are_warned_of(tmp_path: Path) -> None:
    """A 0-d tensor first (a temperature before the inputs) gives 1; so does a dataclass, whose fields the inference
    does not look into: a batch of 8 weighs 1."""
    def step(loop, batch):
        return {"loss": torch.tensor(1.0)}

    caught, _ = run(step, [(torch.tensor(0.5), torch.zeros(8, 2), torch.zeros(8))], tmp_path / "zero-d")
    assert len(said(caught)) == 1 and ("inferred from the batch: 1, as the batch's first tensor, at [0], is "
                                       "0-dimensional; but the batch shows other first dimensions: 8 at [1], "
                                       "[2]. ") in said(caught)[0]
    caught, _ = run(step, [Batch(torch.zeros(8, 2), torch.zeros(8))], tmp_path / "dataclass")
    assert len(said(caught)) == 1 and ("inferred from the batch: 1, as the inference finds no tensor in the batch "
                                       "(a Batch) where it looks; but the batch shows other first dimensions: 8 at "
                                       ".x, .y. ") in said(caught)[0]
    assert said(caught)[0].endswith(FIX % ".x")


@pytest.mark.bad_input
def test_once_a_step_function_and_stage_and_each_validation_set_s_first_batch_is_looked_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One step function for training and validation warns once in each stage; with several validation sets each
    set's first batch is looked at (the second set's layout differs from the first's), and no other batch: the
    batches after a stage's first cost nothing more."""
    looked: list[Any] = []
    ambiguous = batches.ambiguous

    def counted(batch: Any, step: object, scope: str) -> str | None:
        looked.append(scope)
        return ambiguous(batch, step, scope)

    monkeypatch.setattr(batches, "ambiguous", counted)
    good = [(torch.zeros(4, 2), torch.zeros(4))] * 3
    bad = [(torch.zeros(12, 4, 2), torch.zeros(4))] * 3

    def step(loop, batch):
        return {"loss": batch[1].mean()}

    caught, _ = run(step, bad, tmp_path / "stages", val_step=step, val_data=bad, epochs=2)
    assert [text.split(" weighs")[0].split("so ")[1] for text in said(caught)] == ["the train stage", "the valid stage"]
    assert looked == ["the train stage", "the valid stage"]  # warned: not looked at again
    looked.clear()
    caught, _ = run(step, good, tmp_path / "sets", val_step=step, val_data={"a": good, "b": bad}, epochs=2)
    assert [text.split(" weighs")[0].split("so ")[1] for text in said(caught)] == ["the validation set 'b'"]
    assert looked == ["the train stage", "the validation set 'a'", "the validation set 'b'",
                      "the train stage"]  # a stage's first batch, each set's, alone; the validation warned of


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


SILENT = {
    "images and labels": [(torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.long))],
    "a language model's dict": [{"input_ids": torch.zeros(8, 16, dtype=torch.long),
                                 "attention_mask": torch.ones(8, 16), "labels": torch.zeros(8, 16)}],
    "a last, smaller batch": [(torch.zeros(8, 2), torch.zeros(8)), (torch.zeros(3, 2), torch.zeros(3))],
    "one tensor": [torch.zeros(8, 5)],
    "a tensor and a list of text": [(torch.zeros(8, 2), [f"id{i}" for i in range(8)])],
    "a named tuple": [Pair(torch.zeros(8, 2), torch.zeros(8))],
    "a 0-d tensor after the inputs": [(torch.zeros(8, 2), torch.zeros(8), torch.tensor(0.5))],
    "a list of tensors of one sample each field": [(torch.zeros(8, 2), [torch.zeros(8), torch.zeros(8)])],
    "no tensor": [0, 1],
    "a batch of one": [{"x": torch.zeros(1, 2), "y": torch.zeros(1)}],
}


@pytest.mark.parametrize("data", SILENT.values(), ids=SILENT.keys())
def test_batches_whose_tensors_agree_on_the_size_say_nothing(tmp_path: Path, data: list[Any]) -> None:
    def step(loop, batch):
        return {"loss": torch.tensor(1.0)}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookfit.Loop(step, data, val_step=step, val_data=data, run_dir=tmp_path, plugins=[Metrics()]).fit()


def test_a_batch_size_the_step_gives_silences_an_ambiguous_batch(tmp_path: Path) -> None:
    """The step's ``batch_size`` is what weighs the batch: nothing is inferred, nothing said, whatever the batch."""
    data = [recsys(16, 0), recsys(16, 1)]

    def step(loop, batch):
        return {"loss": torch.tensor(1.0), "batch_size": len(batch["label"])}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = hookfit.Loop(step, data, val_step=step, val_data=data, run_dir=tmp_path, plugins=[Metrics()]).fit()
    assert state.status == "completed"
