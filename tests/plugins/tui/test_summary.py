"""hookfit.plugins.support.summary: the size of ``loop.model`` (parameters, trainable, bytes, per top-level module),
checked against counts made here from ``p.numel()`` over ``model.parameters()``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hookfit.payloads import ModelSummary, ModuleRow
from hookfit.plugins.support import unwrap_model as unwrap
from hookfit.plugins.support.summary import DIRECT, summarize


def expected(module: torch.nn.Module) -> tuple[int, int, int, int]:
    """(parameters, trainable, parameter bytes, buffer bytes), each tensor once, counted here."""
    params = list(module.parameters())  # each parameter once, however many modules share it
    buffers = list(module.buffers())
    return (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
            sum(p.numel() * p.element_size() for p in params),
            sum(b.numel() * b.element_size() for b in buffers))


def totals(summary: ModelSummary) -> tuple[int, int, int, int]:
    return summary.parameters, summary.trainable, summary.parameter_bytes, summary.buffer_bytes


def row(module: torch.nn.Module, name: str) -> ModuleRow:
    parameters, trainable, parameter_bytes, buffer_bytes = expected(module)
    return ModuleRow(name, type(module).__name__, parameters, trainable, parameter_bytes + buffer_bytes)


class Seq2Seq(torch.nn.Module):
    """An embedding tied to the output layer, a frozen part, buffers (BatchNorm's, one int64),
    a half-precision head and a parameter of the model itself."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16),
                                           torch.nn.BatchNorm1d(16))
        self.act = torch.nn.ReLU()
        self.decoder = torch.nn.Linear(16, 50)
        self.decoder.weight = self.encoder[0].weight  # tied: one parameter in two modules
        self.head = torch.nn.Linear(16, 3).half()  # 2 bytes an element
        self.scale = torch.nn.Parameter(torch.ones(7))
        self.register_buffer("steps", torch.zeros(5, dtype=torch.float64))
        self.encoder[1].requires_grad_(False)  # frozen


def test_totals_count_shared_parameters_once_frozen_ones_apart_and_buffers_in_the_size() -> None:
    model = Seq2Seq()
    got = summarize(model)
    want = expected(model)
    assert totals(got) == want
    # the model really has each property the counts must handle
    every = [p for _, p in model.named_parameters(remove_duplicate=False)]
    assert sum(p.numel() for p in every) == got.parameters + 50 * 16  # the tied weight, listed twice
    assert got.trainable == got.parameters - (16 * 16 + 16) and got.frozen == 16 * 16 + 16
    assert got.buffer_bytes == 16 * 4 * 2 + 8 + 5 * 8  # BatchNorm's running stats and count, `steps`
    assert got.parameter_bytes != 4 * got.parameters  # the half-precision head
    assert got.bytes == want[2] + want[3] and got.size_mb == got.bytes / 2**20
    assert (got.type, got.uninitialised) == ("Seq2Seq", 0)


def test_one_row_per_top_level_module_and_one_for_the_models_own_tensors() -> None:
    model = Seq2Seq()
    got = summarize(model)
    own = ModuleRow(DIRECT, "Seq2Seq", 7, 7, 7 * 4 + 5 * 8)  # `scale` and the float64 `steps`
    decoder = ModuleRow("decoder", "Linear", 50, 50, 50 * 4, 0, ("encoder",))  # its bias; its weight is the encoder's
    assert got.modules == (row(model.encoder, "encoder"), row(model.act, "act"), decoder, row(model.head, "head"), own)
    assert got.modules[0] == ("encoder", "Sequential", 50 * 16 + 16 * 16 + 16 + 32, 50 * 16 + 32,
                              (50 * 16 + 16 * 16 + 16 + 32) * 4 + 16 * 4 * 2 + 8, 0, ())
    # the tied weight is counted once, in the first row that holds it: the rows add up to the totals
    assert sum(r.parameters for r in got.modules) == got.parameters
    assert sum(r.trainable for r in got.modules) == got.trainable
    assert sum(r.bytes for r in got.modules) == got.bytes


class TiedLM(torch.nn.Module):
    """A language model's shape: every parameter in a child, the head tied to the embedding,
    a causal mask as the model's own buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(20, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 20, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("mask", torch.triu(torch.ones(4, 4)), persistent=False)


def test_a_model_holding_no_parameter_itself_has_no_direct_row_and_a_tied_head_counts_nothing_twice(
        capsys: pytest.CaptureFixture[str]) -> None:
    got = summarize(TiedLM())
    assert [r.name for r in got.modules] == ["tok", "ln", "head"]  # no "(direct)" row for the mask alone
    assert got.modules[2] == ModuleRow("head", "Linear", 0, 0, 0, 0, ("tok",))
    assert sum(r.parameters for r in got.modules) == got.parameters == 20 * 8 + 2 * 8
    from hookfit.plugins.console import Console

    Console()._print_model(got)
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("hookfit model module=head type=Linear params=0 ") and lines[3].endswith(" tied_to=tok")
    assert not any(DIRECT in line for line in lines)


def test_a_model_without_children_is_one_row_and_no_model_is_an_empty_summary() -> None:
    linear = torch.nn.Linear(4, 2)
    assert summarize(linear).modules == (ModuleRow(DIRECT, "Linear", 10, 10, 40),)
    empty = summarize(None)
    assert totals(empty) == (0, 0, 0, 0) and empty.modules == () and empty.type == ""


def test_a_dict_or_list_of_models_has_a_row_per_model_and_shared_layers_counted_once() -> None:
    generator = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    shared = torch.nn.Linear(8, 4)
    critic_a = torch.nn.Sequential(shared, torch.nn.Linear(4, 1))
    critic_b = torch.nn.Sequential(shared, torch.nn.Linear(4, 1))  # shares its first layer with critic_a
    critic_b.requires_grad_(False)  # and freezes it: shared and frozen, counted once, as frozen
    got = summarize({"generator": generator, "critics": [critic_a, critic_b]})
    everything = torch.nn.ModuleList([generator, critic_a, critic_b])  # model.parameters() dedupes
    assert totals(got) == expected(everything)
    assert got.parameters == 8 * 32 + 32 + 32 * 8 + 8 + 8 * 4 + 4 + 5 + 5
    assert got.trainable == got.parameters - (8 * 4 + 4) - 5
    critic_b_own = ModuleRow("critics.1", "Sequential", 5, 0, 5 * 4, 0, ("critics.0",))  # the shared layer: critic_a's
    assert got.modules == (row(generator, "generator"), row(critic_a, "critics.0"), critic_b_own)
    assert got.type == "dict"
    assert summarize([generator]).modules == (row(generator, "0"),)


def ddp_around(module: torch.nn.Module) -> torch.nn.Module:
    """A real DistributedDataParallel instance around ``module`` without a process group (its
    constructor needs one; unwrapping reads only ``.module``)."""
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(ddp)
    ddp.module = module
    return ddp


def test_wrappers_are_looked_through() -> None:
    model = Seq2Seq()
    bare = summarize(model)
    for wrapped in (ddp_around(model), torch.nn.DataParallel(model), ddp_around(torch.nn.DataParallel(model))):
        assert unwrap(wrapped) is model
        assert summarize(wrapped) == bare  # same totals, rows named after the user's children
    inside = summarize({"net": ddp_around(model)})
    assert inside.modules == (row(model, "net"),) and totals(inside) == totals(bare)


def test_lazy_modules_are_counted_as_far_as_they_can_be() -> None:
    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.LazyBatchNorm1d(), torch.nn.Linear(8, 2))
    got = summarize(model)  # no crash on UninitializedParameter / UninitializedBuffer
    assert got.uninitialised == 4 + 2  # weight and bias of both lazy modules; BatchNorm's running stats
    assert (got.parameters, got.trainable) == (8 * 2 + 2, 8 * 2 + 2)  # what can be counted
    assert got.buffer_bytes == 8  # num_batches_tracked is an ordinary buffer
    assert [(r.name, r.parameters, r.uninitialised) for r in got.modules] == [("0", 0, 2), ("1", 0, 4), ("2", 18, 0)]
    assert str(got).endswith(", 6 tensors not initialised yet (lazy)")
    model(torch.randn(4, 5))  # the first forward pass initialises them
    after = summarize(model)
    assert after.uninitialised == 0 and totals(after) == expected(model)
    assert after.parameters == 5 * 8 + 8 + 8 + 8 + 8 * 2 + 2


def test_the_summary_is_immutable_and_reads_well() -> None:
    got = ModelSummary(1_234_567, 1_200_000, 4_938_268, 0, [ModuleRow("encoder", "Sequential", 1, 1, 4)])
    assert isinstance(got.modules, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.parameters = 0  # type: ignore[misc]
    assert str(got) == "1.23M params (1.2M trainable), 4.71 MB"
    assert f"{got.size_mb:.2f}" == "4.71" and got.frozen == 34_567
    assert str(ModelSummary(860, 0, 3_440, 100)) == "860 params (0 trainable), 3.46 kB"
    assert str(ModelSummary(999_500, 999_500, 100, 0)) == "1M params (1M trainable), 100 B"


@pytest.mark.bad_input
def test_what_is_not_a_model_is_refused_naming_it() -> None:
    refused = "summarize: the model must be a torch.nn.Module, a mapping or a list of modules; "
    with pytest.raises(TypeError, match=refused + "got int$"):
        summarize(42)
    with pytest.raises(TypeError, match=refused + r"got str at model\['critic'\]$"):
        summarize({"generator": torch.nn.Linear(1, 1), "critic": "critic.pt"})
