"""What ported scripts ran into: toggle's note on the backward pass it broke, and
evaluating a checkpoint on a Loop without optimizers."""

from __future__ import annotations

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim

# -- toggle ------------------------------------------------------------------------------------


def gan():
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    discriminator = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Sigmoid())
    return generator, discriminator


REAL = [torch.randn(16, 2, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def bce(p: torch.Tensor, target: float) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy(p, torch.full_like(p, target))


def fit_gan(g, d, forward_inside: bool):
    """The DCGAN step as it is often ported: the generator's forward pass inside the
    discriminator's toggle (``forward_inside``), or before it, as the original script has it."""

    def step(loop, real):
        opts = loop.optimizers
        noise = torch.randn(16, 2, generator=torch.Generator().manual_seed(loop.state.step))
        if not forward_inside:
            fake = g(noise)
        with opts.toggle("D"):
            if forward_inside:
                fake = g(noise)
            d_loss = bce(d(real), 1.0) + bce(d(fake.detach()), 0.0)
            opts["D"].zero_grad()
            loop.backward(d_loss)
            opts["D"].step()
        with opts.toggle("G"):
            g_loss = bce(d(fake), 1.0)
            opts["G"].zero_grad()
            loop.backward(g_loss)
            opts["G"].step()
        return {"d_loss": d_loss, "g_loss": g_loss}

    return hookfit.Loop(step, REAL, model={"G": g, "D": d},
                        optimizers={"G": torch.optim.Adam(g.parameters(), lr=1e-3),
                                    "D": torch.optim.Adam(d.parameters(), lr=1e-3)},
                        plugins=[Optim()]).fit()


def test_a_backward_through_what_a_toggle_froze_names_the_toggle_and_its_parameters() -> None:
    g, d = gan()
    with pytest.raises(RuntimeError, match="does not require grad") as info:
        fit_gan(g, d, forward_inside=True)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert ("loop.optimizers.toggle('D') froze the 4 parameter tensor(s) of optimizer 'G' "
            "(G.0.weight, G.0.bias, G.2.weight, G.2.bias)") in notes, notes
    assert "requires_grad=False" in notes and "Compute that tensor outside the block" in notes
    assert all(p.requires_grad for p in [*g.parameters(), *d.parameters()])  # given back after the failure


def test_the_forward_pass_outside_the_toggle_trains_both() -> None:
    g, d = gan()
    before = [p.detach().clone() for p in g.parameters()]
    assert fit_gan(g, d, forward_inside=False).status == "completed"
    assert all(not torch.equal(a, b) for a, b in zip(before, g.parameters()))


def test_no_note_for_a_toggle_of_another_batch() -> None:
    m = torch.nn.Linear(2, 1)
    other = torch.nn.Linear(2, 1)

    def step(loop, batch):
        if loop.state.batch_idx == 0:
            with loop.optimizers.toggle("a"):
                pass
        else:
            loop.backward(torch.zeros(()))  # nothing requires a gradient, no toggle in this batch

    loop = hookfit.Loop(step, [0, 1], model=[m, other], plugins=[Optim()],
                        optimizers={"a": torch.optim.SGD(m.parameters()), "b": torch.optim.SGD(other.parameters())})
    with pytest.raises(RuntimeError, match="does not require grad") as info:
        loop.fit()
    assert not any(note.startswith("optim:") for note in getattr(info.value, "__notes__", []))


# -- evaluating a checkpoint -------------------------------------------------------------------


def data(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


TRAIN, VALID = data(5, 0), data(3, 1)


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def train_step(loop, batch):
    loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return loss


def val_step(loop, batch):
    return torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])


class ValidLoss:
    name = "valid_loss"

    def __init__(self) -> None:
        self.seen: list[float] = []

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics):
        if stage == "valid":
            self.seen.append(metrics.values["loss"].epoch)


def test_validate_resumes_a_checkpoint_on_a_loop_without_optimizers(tmp_path) -> None:
    """Train with checkpoints, then evaluate the last one on a new Loop given only the model:
    it used to fail in optim (the checkpoint has optimizers ['default'], this run [])."""
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    trained = ValidLoss()
    hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=opt, max_epochs=2,
                 run_dir=tmp_path / "train", plugins=[Optim(schedulers=sched, scheduler_interval="epoch"), Metrics(),
                                                      Checkpoint(background=False), trained]).fit()
    last = sorted((tmp_path / "train" / "checkpoints").glob("*.pt"))[-1]
    evaluated = ValidLoss()
    fresh = model()
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), m.parameters()))
    state = hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=fresh,
                         run_dir=tmp_path / "evaluate",
                         plugins=[Optim(), Metrics(), Checkpoint(background=False), evaluated]).validate(resume=last)
    assert state.status == "completed"
    assert evaluated.seen == trained.seen[-1:]  # the same weights, the same loss, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), m.parameters()))


@pytest.mark.bad_input
def test_a_training_run_resumed_without_its_optimizers_is_still_refused(tmp_path) -> None:
    m = model()
    hookfit.Loop(train_step, TRAIN, model=m, optimizers=torch.optim.SGD(m.parameters(), lr=0.1), run_dir=tmp_path,
                 plugins=[Optim(), Checkpoint(background=False)]).fit()
    steps = []
    loop = hookfit.Loop(lambda loop, b: steps.append(b), TRAIN, model=model(), run_dir=tmp_path, max_epochs=2,
                        resume="latest", plugins=[Optim(), Checkpoint(background=False)])
    with pytest.raises(ValueError, match=r"optim: the checkpoint has optimizers \['default'\], this run \[\]"):
        loop.fit()
    assert steps == []


@pytest.mark.bad_input
def test_evaluating_a_checkpoint_trained_in_bf16_without_its_precision_is_told_once(tmp_path) -> None:
    """A checkpoint of a run trained under precision='bf16-mixed' evaluated without Optim(precision=...) ran in
    float32, its metrics not those the run's validations measured, with no word (as the EMA plugin tells an
    evaluation of an average it does not validate). One OptimWarning at the validate() line names the precision
    and the plugin to give; given it, the evaluation measures what the run measured, bit for bit, and says nothing."""
    import warnings

    from hookfit.plugins.optim import OptimWarning

    m = model()
    trained = ValidLoss()
    hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=torch.optim.Adam(
        m.parameters(), lr=0.01), max_epochs=1, run_dir=tmp_path / "train",
        plugins=[Optim(precision="bf16-mixed"), Metrics(), Checkpoint(background=False), trained]).fit()
    last = sorted((tmp_path / "train" / "checkpoints").glob("*.pt"))[-1]

    def evaluate(**precision: str) -> tuple[list[float], list[warnings.WarningMessage]]:
        evaluated = ValidLoss()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hookfit.Loop(val_step=val_step, val_data=VALID, model=model(), run_dir=tmp_path / "evaluate",
                         plugins=[Optim(**precision), Metrics(), Checkpoint(background=False), evaluated]
                         ).validate(resume=last)
        return evaluated.seen, [w for w in caught if issubclass(w.category, OptimWarning)]

    seen, told = evaluate()
    assert len(told) == 1 and told[0].filename == __file__, told
    assert str(told[0].message) == (
        "optim: the checkpoint's run trained with precision='bf16-mixed', and this evaluation runs in float32: its "
        "metrics are not those the run's validations measured. To evaluate as the run did, give "
        "Loop(plugins=[Optim(precision='bf16-mixed')])")
    assert seen != trained.seen[-1:]  # float32's numbers
    seen, told = evaluate(precision="bf16-mixed")
    assert told == [] and seen == trained.seen[-1:]
