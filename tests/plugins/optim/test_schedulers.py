"""optim's schedulers as training scripts use them: ReduceLROnPlateau on a monitored metric,
per-step and per-epoch schedulers, chains and lists, each equal to the script's own loop; every
misuse named when Optim is built or the run starts; exact resume with their states."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.metrics import Metrics
from hookfit.plugins.optim import Optim, OptimWarning
from conftest import StopAfter, mse_step

lr_scheduler = torch.optim.lr_scheduler


def data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


TRAIN, VALID = data(6), data(3, seed=1)


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def mse(m: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(batch[0]), batch[1])


def params(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def train_step(loop, batch):
    loss = mse(loop.model, batch)
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    return {"loss": loss}


def val_step(loop, batch):
    return {"loss": mse(loop.model, batch)}


class Lrs:
    """The learning rate at every epoch's end."""

    name = "lrs"

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.seen = opt, []

    @hookfit.hookimpl
    def epoch_end(self, loop, epoch):
        self.seen.append(self.opt.param_groups[0]["lr"])


def run(m, opt, *plugins, epochs=4, **options):
    return hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=opt,
                        max_epochs=epochs, plugins=[Optim(**options), Metrics(), *plugins]).fit()


def raw_epoch(m, opt, per_step=()) -> None:
    for batch in TRAIN:
        opt.zero_grad()
        mse(m, batch).backward()
        opt.step()
        for scheduler in per_step:
            scheduler.step()


def raw_valid_loss(m) -> float:
    with torch.inference_mode():  # equal batch sizes: the sample-weighted mean is the mean
        return sum(mse(m, b).item() for b in VALID) / len(VALID)


# -- ReduceLROnPlateau ---------------------------------------------------------------------


def test_reduce_lr_on_plateau_steps_on_the_validation_loss_as_the_script_does() -> None:
    """The word language model's schedule: lr reduced when the validation loss stops falling.
    It steps on that loss, not failing at the first step with torch's "step() missing 'metrics'"."""
    raw = model()
    opt = torch.optim.SGD(raw.parameters(), lr=0.6)
    sched = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    raw_lrs = []
    for _ in range(6):
        raw_epoch(raw, opt)
        sched.step(raw_valid_loss(raw))
        raw_lrs.append(opt.param_groups[0]["lr"])

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.6)
    lrs = Lrs(opt)
    plateau = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    run(m, opt, lrs, epochs=6, schedulers=plateau, monitor="valid/loss")
    assert lrs.seen == raw_lrs and len(set(raw_lrs)) > 1, raw_lrs  # it did reduce
    assert plateau.last_epoch == 6  # once per epoch
    assert same(params(m), params(raw))


def test_a_train_monitor_steps_each_epoch_and_a_valid_one_each_validation() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    plateau = lr_scheduler.ReduceLROnPlateau(opt)
    hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=opt, max_epochs=4,
                 val_every_n_epochs=2, plugins=[Optim(schedulers=plateau, monitor="valid/loss"), Metrics()]).fit()
    assert plateau.last_epoch == 2
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    plateau = lr_scheduler.ReduceLROnPlateau(opt)
    run(m, opt, epochs=3, schedulers=plateau, monitor="train/loss")
    assert plateau.last_epoch == 3
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    plateau = lr_scheduler.ReduceLROnPlateau(opt)  # with validation inside training: each validation
    hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=opt, max_epochs=2,
                 val_every_n_steps=3, plugins=[Optim(schedulers=plateau, monitor="valid/loss"), Metrics()]).fit()
    assert plateau.last_epoch == 4


def test_a_stage_cut_short_steps_no_plateau() -> None:
    """A stop inside the validation: that stage's partial metrics are no epoch to step on."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    plateau = lr_scheduler.ReduceLROnPlateau(opt)
    # epoch 1 runs 6 + 3 batches; the stop comes after the 2nd validation batch of epoch 2
    state = run(m, opt, StopAfter(9 + 6 + 2), epochs=3, schedulers=plateau, monitor="valid/loss")
    assert state.status == "interrupted" and plateau.last_epoch == 1


def test_a_validation_steps_no_scheduler_and_needs_none_of_the_optimizers() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    plateau = lr_scheduler.ReduceLROnPlateau(opt)
    loop = hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=m,
                        plugins=[Optim(schedulers=plateau, monitor="valid/loss"), Metrics()])
    assert loop.validate().status == "completed"
    assert plateau.last_epoch == 0


@pytest.mark.bad_input
def test_a_monitored_metric_the_run_lacks_names_the_metrics_there_are() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optim: monitor='valid/acc' names a metric this run does not "
                                         r"produce: the valid metrics of epoch 1 are loss\n"):  # none close
        run(m, opt, schedulers=lr_scheduler.ReduceLROnPlateau(opt), monitor="valid/acc")
    with pytest.raises(ValueError, match=r"optim: monitor='valid/los' names a metric this run does not produce: the "
                                         r"valid metrics of epoch 1 are loss; did you mean monitor='valid/loss'\?"):
        run(m, opt, schedulers=lr_scheduler.ReduceLROnPlateau(opt), monitor="valid/los")


@pytest.mark.bad_input
def test_a_monitor_without_a_metrics_plugin_fails_at_the_epoch_end() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    steps = []
    loop = hookfit.Loop(lambda loop, b: steps.append(train_step(loop, b)), TRAIN, val_step=val_step,
                        val_data=VALID, model=m, optimizers=opt, max_epochs=2,
                        plugins=[Optim(schedulers=lr_scheduler.ReduceLROnPlateau(opt), monitor="valid/loss")])
    with pytest.raises(ValueError, match=r"optim: monitor='valid/loss', and no plugin published the valid "
                                         r"metrics of epoch 1 .*is the metrics plugin enabled"):
        loop.fit()
    assert len(steps) == len(TRAIN)  # the first epoch's end


@pytest.mark.bad_input
def test_a_valid_monitor_in_a_run_without_validation_fails_before_any_batch() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    steps = []
    loop = hookfit.Loop(lambda loop, b: steps.append(b), TRAIN, model=m, optimizers=opt,
                        plugins=[Optim(schedulers=lr_scheduler.ReduceLROnPlateau(opt), monitor="valid/loss")])
    with pytest.raises(ValueError, match=r"optim: monitor='valid/loss' .* this run has no validation"):
        loop.fit()
    assert steps == []


def accuracy_step(loop, batch):
    """A validation step whose ``acc`` rises as the model learns (the fraction of outputs within 1 of the target)."""
    return {"acc": ((loop.model(batch[0]) - batch[1]).abs() < 1).float().mean(), "loss": mse(loop.model, batch)}


def plateau_run(mode: str | None, monitor: str = "valid/acc", best: dict | None = None) -> tuple[list[str], list]:
    """The OptimWarnings of a run whose ReduceLROnPlateau (``mode``, torch's "min" when ``None``) steps on
    ``monitor``, ``best`` the directions given to Metrics; and the learning rate at each epoch's end."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.3)
    plateau = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, **({"mode": mode} if mode else {}))
    lrs = Lrs(opt)
    loop = hookfit.Loop(train_step, TRAIN * 4, val_step=accuracy_step, val_data=VALID, model=m, optimizers=opt,
                        max_epochs=4, plugins=[Optim(schedulers=plateau, monitor=monitor), Metrics(best=best), lrs])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit()
    said = [w for w in caught if issubclass(w.category, OptimWarning) and "ReduceLROnPlateau" in str(w.message)]
    assert all(w.filename == __file__ for w in said)  # the fit() line
    return [str(w.message) for w in said], lrs.seen


@pytest.mark.bad_input
def test_a_plateau_left_at_min_on_a_metric_published_as_higher_is_better_warns_once_naming_the_fix() -> None:
    """Lightning's ReduceLROnPlateau(opt) on an accuracy: the learning rate was cut each time it improved."""
    said, lrs = plateau_run(None, best={"valid/acc": "max"})
    assert said == [
        "optim: the ReduceLROnPlateau of optimizer 'default' has mode='min' and steps on monitor='valid/acc', whose "
        "direction the metrics plugin publishes as 'max' (Metrics(best=...)): it takes each improvement for none and "
        "cuts the learning rate while valid/acc improves. Build it with ReduceLROnPlateau(opt, mode='max')"]
    assert lrs[-1] < 0.3  # (what it warns of: the rate was cut)


def test_a_plateau_whose_mode_is_the_metrics_direction_or_a_direction_not_published_says_nothing() -> None:
    assert plateau_run("max", best={"valid/acc": "max"})[0] == []
    assert plateau_run(None, monitor="valid/loss", best={"valid/loss": "min", "valid/acc": "max"})[0] == []
    assert plateau_run("max")[0] == []  # nothing published: nothing contradicted


# -- per step, per epoch, chains and lists ---------------------------------------------------


def test_step_lr_per_epoch_as_the_mnist_script_steps_it() -> None:
    raw = model()
    opt = torch.optim.Adadelta(raw.parameters(), lr=1.0)
    sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for _ in range(3):
        raw_epoch(raw, opt)
        sched.step()
    m = model()
    opt = torch.optim.Adadelta(m.parameters(), lr=1.0)
    run(m, opt, epochs=3, schedulers=lr_scheduler.StepLR(opt, step_size=1, gamma=0.7), scheduler_interval="epoch")
    assert same(params(m), params(raw)) and opt.param_groups[0]["lr"] == pytest.approx(0.7 ** 3)


def _chain(opt, kind):
    warmup = lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
    decay = lr_scheduler.ExponentialLR(opt, gamma=0.9)
    if kind == "chained":
        return lr_scheduler.ChainedScheduler([warmup, decay])
    if kind == "sequential":
        return lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[4])
    return [warmup, decay]  # a list, as a script that steps both writes it


@pytest.mark.parametrize("kind", ["chained", "sequential", "list"])
def test_chained_and_listed_schedulers_step_per_step_as_the_script_does(kind: str) -> None:
    raw = model()
    opt = torch.optim.SGD(raw.parameters(), lr=0.2, momentum=0.9)
    given = _chain(opt, kind)
    for _ in range(2):
        raw_epoch(raw, opt, given if isinstance(given, list) else [given])
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
    run(m, opt, epochs=2, schedulers=_chain(opt, kind))
    assert same(params(m), params(raw))


def step_each(loop, batch):
    """A step of a run with several optimizers: each stepped and cleared by name."""
    loss = mse(loop.model, batch)
    loop.backward(loss)
    for opt in loop.optimizers.values():
        opt.step()
        opt.zero_grad()
    return loss


def test_with_two_optimizers_each_scheduler_drives_the_one_it_was_built_on() -> None:
    """No names needed: a list of schedulers of two optimizers, and a dict keyed by name."""
    m = model()
    first, second = list(m.children())[0], list(m.children())[2]
    for keyed in (False, True):
        a, b = torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)
        sa, sb = lr_scheduler.StepLR(a, 1, gamma=0.5), lr_scheduler.StepLR(b, 1, gamma=0.1)

        schedulers = {"b": sb, "a": [sa]} if keyed else [sb, sa]
        hookfit.Loop(step_each, TRAIN[:2], model=m, optimizers={"a": a, "b": b}, max_epochs=1,
                     plugins=[Optim(schedulers=schedulers)]).fit()
        assert a.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
        assert b.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 ** 2)


def _fine_tuning(folder=None, interval=None, stop=None, resume=None):
    """A backbone on a StepLR each epoch, a head on a OneCycleLR each step (Lightning's "interval")."""
    m = model()
    backbone, head = list(m.children())[0], list(m.children())[2]
    a, b = torch.optim.SGD(backbone.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    epochwise, stepwise = lr_scheduler.StepLR(a, 1, gamma=0.5), lr_scheduler.OneCycleLR(b, 1.0, total_steps=18)

    seen = []

    class Rates:
        name = "rates"

        @hookfit.hookimpl
        def batch_end(self, loop):
            seen.append((a.param_groups[0]["lr"], b.param_groups[0]["lr"]))

    plugins = [Optim(schedulers=[epochwise, stepwise], scheduler_interval=interval or {"backbone": "epoch"}), Rates(),
               *([Checkpoint(background=False)] if folder else []), *([StopAfter(stop)] if stop else [])]
    state = hookfit.Loop(step_each, TRAIN, model=m, optimizers={"backbone": a, "head": b}, max_epochs=3, run_dir=folder,
                         resume=resume, plugins=plugins).fit()
    return state, seen, params(m)


def test_each_optimizers_schedulers_step_at_its_own_interval(tmp_path) -> None:
    """scheduler_interval by optimizer name: the backbone's schedule each epoch, the head's (given none) each step,
    as a script that steps each where it belongs; resumed inside an epoch, bit for bit."""
    _, seen, _ = _fine_tuning()
    ref = model()
    a = torch.optim.SGD(list(ref.children())[0].parameters(), lr=0.1)
    b = torch.optim.SGD(list(ref.children())[2].parameters(), lr=0.1)
    epochwise, stepwise = lr_scheduler.StepLR(a, 1, gamma=0.5), lr_scheduler.OneCycleLR(b, 1.0, total_steps=18)
    expected = []
    for _ in range(3):
        for _ in TRAIN:
            b.step()  # (no gradient: the step's place only)
            stepwise.step()
            expected.append((a.param_groups[0]["lr"], b.param_groups[0]["lr"]))
        a.step()
        epochwise.step()
    assert seen == expected and [r[0] for r in seen[::6]] == [0.1, 0.05, 0.025]
    whole = _fine_tuning(tmp_path / "whole")
    assert _fine_tuning(tmp_path / "split", stop=8)[0].status == "interrupted"
    rest = _fine_tuning(tmp_path / "split", resume="latest")
    assert rest[1] == whole[1][8:] and same(rest[2], whole[2])


@pytest.mark.bad_input
@pytest.mark.parametrize("interval, message", [
    ({"backbone": "batch"}, r"optim: scheduler_interval\['backbone'\] must be 'step' or 'epoch', got 'batch'"),
    ({"backbone": None}, r"optim: scheduler_interval\['backbone'\] must be 'step' or 'epoch', got None"),
])
def test_an_interval_by_name_is_checked_when_optim_is_built(interval, message) -> None:
    with pytest.raises(ValueError, match=message):
        Optim(scheduler_interval=interval)


@pytest.mark.bad_input
@pytest.mark.parametrize("interval, message", [
    ({"body": "epoch"},
     r"optim: scheduler_interval \['body'\] name no optimizer; optimizers are \['backbone', 'head'\]"),
    ({"backbone": "step"}, r"optim: scheduler_interval\['backbone'\]='step' cannot step a ReduceLROnPlateau"),
])
def test_an_interval_by_name_is_checked_against_the_runs_optimizers_before_any_batch(interval, message) -> None:
    m = model()
    a, b = torch.optim.SGD(m[0].parameters(), lr=0.1), torch.optim.SGD(m[2].parameters(), lr=0.1)
    steps = []
    loop = hookfit.Loop(lambda loop, batch: steps.append(batch), [1, 2], optimizers={"backbone": a, "head": b},
                        plugins=[Optim(schedulers=lr_scheduler.ReduceLROnPlateau(a), monitor="train/loss",
                                       scheduler_interval=interval), Metrics()])
    with pytest.raises(ValueError, match=message):
        loop.fit()
    assert steps == []


# -- bad input: when Optim is built, and when the run starts --------------------------------

_opt = torch.optim.SGD(model().parameters(), lr=0.1)
_other = torch.optim.SGD(model().parameters(), lr=0.1)
_step = lr_scheduler.StepLR(_opt, 1)
_plateau = lr_scheduler.ReduceLROnPlateau(_opt)


@pytest.mark.bad_input
@pytest.mark.parametrize("options, error, message", [
    ({"schedulers": _plateau}, ValueError,
     r"optim: schedulers has a ReduceLROnPlateau, which steps on a metric: give monitor='<stage>/<metric>'"),
    ({"schedulers": _step, "monitor": "valid/loss"}, ValueError,
     r"optim: monitor='valid/loss' is the metric a ReduceLROnPlateau steps on, and schedulers has none \(StepLR\)"),
    ({"monitor": "valid/loss"}, ValueError, r"schedulers has none \(no scheduler\)"),
    ({"schedulers": _plateau, "monitor": "valid/loss", "scheduler_interval": "step"}, ValueError,
     r"optim: scheduler_interval='step' cannot step a ReduceLROnPlateau"),
    ({"schedulers": _plateau, "monitor": "loss"}, ValueError, r"optim: monitor must be '<stage>/<metric>'"),
    ({"schedulers": _step, "scheduler_interval": "batch"}, ValueError,
     r"optim: scheduler_interval must be 'step', 'epoch' or None, got 'batch'"),
    ({"schedulers": "cosine"}, TypeError, r"optim: schedulers must be a learning-rate scheduler .*, got 'cosine'"),
    ({"schedulers": lr_scheduler.StepLR}, TypeError, r"got the class StepLR \(build one: StepLR\(optimizer, ...\)\)"),
    ({"schedulers": {"g": [_step, _opt]}}, TypeError, r"optim: schedulers\['g'\] must be .*, got a SGD"),
    ({"schedulers": [_step, _step]}, ValueError, r"optim: schedulers: the same StepLR is given twice"),
    ({"schedulers": [lr_scheduler.ChainedScheduler([_step]), _step]}, ValueError,
     r"the same StepLR is given twice \(inside the ChainedScheduler and on its own\)"),
    ({"schedulers": {"g": [_step, lr_scheduler.StepLR(_other, 1)]}}, ValueError,
     r"optim: schedulers\['g'\]: its StepLR and StepLR are built on different optimizers"),
    ({"schedulers": {"scheduler": _step, "interval": "epoch"}}, TypeError,  # Lightning's, by habit
     r"^optim: schedulers: a dict's keys are optimizer names, and this one is Lightning's scheduler configuration "
     r"\('scheduler', 'interval'\): give Optim\(schedulers=<the scheduler>, scheduler_interval='epoch'\)$"),
    ({"schedulers": {"scheduler": _plateau, "monitor": "val_loss"}}, TypeError,
     r"scheduler_interval='epoch'\), with monitor='<stage>/<metric>' for the metric it steps on$"),
])
def test_schedulers_are_checked_when_optim_is_built(options, error, message) -> None:
    with pytest.raises(error, match=message):
        Optim(**options)


@pytest.mark.bad_input
@pytest.mark.parametrize("schedulers, optimizers, message", [
    (lambda: lr_scheduler.StepLR(_other, 1), lambda: _opt,
     r"optim: schedulers: the StepLR is built on a SGD that is not one of this run's optimizers \('default': SGD\)"),
    (lambda: {"g": lr_scheduler.StepLR(_other, 1)}, lambda: {"g": _opt, "d": _other},
     r"optim: schedulers\['g'\]: the StepLR is built on optimizer 'd', not 'g'"),
    (lambda: {"gen": lr_scheduler.StepLR(_opt, 1)}, lambda: {"g": _opt},
     r"optim: schedulers \['gen'\] name no optimizer; optimizers are \['g'\]"),
])
def test_a_scheduler_of_no_optimizer_of_the_run_fails_before_any_batch(schedulers, optimizers, message) -> None:
    steps = []
    loop = hookfit.Loop(lambda loop, b: steps.append(b), [1, 2], optimizers=optimizers(),
                        plugins=[Optim(schedulers=schedulers())])
    with pytest.raises(ValueError, match=message):
        loop.fit()
    assert steps == []


# -- checkpoints -----------------------------------------------------------------------------


def _checkpointed(folder, stop=None, epochs=5, resume=None):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.6, momentum=0.5)
    plateau = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    warmup = lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=8)
    lrs = Lrs(opt)
    plugins = [Optim(schedulers=[warmup, plateau], monitor="valid/loss"), Metrics(),
               Checkpoint(background=False), lrs, *([stop] if stop is not None else [])]
    state = hookfit.Loop(train_step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=opt,
                         max_epochs=epochs, run_dir=folder, resume=resume, plugins=plugins).fit()
    return state, params(m), lrs.seen, plateau.state_dict(), opt.state_dict()["param_groups"]


@pytest.mark.parametrize("stop_after", [6 + 3 + 4, 2 * (6 + 3) + 6 + 1, 9 * 3])  # in training, in validation,
def test_a_run_with_a_plateau_resumes_bit_for_bit(tmp_path, stop_after: int) -> None:  # the last batch of epoch 3
    whole = _checkpointed(tmp_path / "whole")
    assert len(set(whole[2])) > 2  # the warmup and the plateau both changed the rate
    first = _checkpointed(tmp_path / "split", StopAfter(stop_after))
    assert first[0].status == "interrupted"
    rest = _checkpointed(tmp_path / "split", resume="latest")
    assert rest[0].step == whole[0].step == 30 and rest[0].resumed_from is not None
    assert same(rest[1], whole[1])
    assert first[2] + rest[2] == whole[2]
    assert rest[3] == whole[3] and rest[4] == whole[4]


@pytest.mark.bad_input
def test_resuming_with_other_schedulers_is_refused_naming_both(tmp_path) -> None:
    def fit(schedulers, epochs=2, resume="latest"):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        return hookfit.Loop(train_step, TRAIN, model=m, optimizers=opt, run_dir=tmp_path, max_epochs=epochs,
                            resume=resume, plugins=[Optim(schedulers=schedulers(opt)), Checkpoint(background=False)]
                            ).fit()

    fit(lambda opt: lr_scheduler.StepLR(opt, 1), epochs=1, resume=None)
    with pytest.raises(ValueError, match=r"optim: optimizer 'default' has no scheduler in this run and the "
                                         r"schedulers \[StepLR\] in the checkpoint"):
        fit(lambda opt: None)
    with pytest.raises(ValueError, match=r"has the schedulers \[ExponentialLR\] in this run and the schedulers "
                                         r"\[StepLR\] in the checkpoint"):
        fit(lambda opt: lr_scheduler.ExponentialLR(opt, 0.5))
    assert fit(lambda opt: lr_scheduler.StepLR(opt, 1)).step == 12


@pytest.mark.bad_input
def test_a_scheduler_the_step_drives_itself_is_warned_of_as_in_no_checkpoint(tmp_path) -> None:
    """A per-step schedule stepped in the step function (the plain PyTorch port) trains as the
    script says, but optim neither saves nor restores it: a run stopped and resumed started
    its warmup and decay again, silently. One warning, at the fit() line, names the optimizer
    and the fix; a scheduler given to Optim and an evaluation say nothing."""
    import warnings

    def fit(given: bool, mode: str = "fit") -> list[str]:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

        def step(loop, batch):
            out = train_step(loop, batch)
            if not given:
                sched.step()
            return out

        loop = hookfit.Loop(step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=opt, max_epochs=1,
                            run_dir=tmp_path / f"{given}-{mode}", plugins=[Optim(schedulers=sched if given else None)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loop.fit() if mode == "fit" else loop.validate()
        return [f"{w.filename.rsplit('/', 1)[-1]}: {w.message}" for w in caught if "scheduler" in str(w.message)]

    assert fit(given=False) == [
        "test_schedulers.py: optim: optimizer 'default' has a learning-rate scheduler built on it that was not given "
        "to Optim(schedulers=...): its state is in no checkpoint, so a resumed run starts its schedule again; give it "
        "as Optim(schedulers=scheduler) (with scheduler_interval=\"epoch\" for one stepped once an epoch) and do not "
        "step it yourself"]
    assert fit(given=True) == [] and fit(given=False, mode="validate") == []


def test_a_scheduler_given_to_optim_and_also_stepped_in_the_step_warns_once(tmp_path) -> None:
    """A scheduler given to ``Optim(schedulers=...)`` that the step function steps as well (the
    plain port's ``sched.step()`` left in) moves twice a step: its warmup and decay run twice
    as fast, silently. One warning names it and both counts, at the first optimizer step that shows
    it (watched: the first training stage's first passes), not after the stage (an LM's one long
    epoch: after all the training); a run ended before (``max_steps``) is told at its end. A scheduler optim
    alone steps (per step with accumulation, per epoch, on a plateau monitored in validations inside
    training, a chain) says nothing."""
    import warnings

    def fit(by_hand: bool, epochs: int = 2, max_steps: int | None = None, chain: bool = False, **options) -> list[str]:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        plateau = options.pop("plateau", False)
        sched = lr_scheduler.ReduceLROnPlateau(opt) if plateau else lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        if chain:  # no count of its own (torch 2.13): its first scheduler's
            sched = lr_scheduler.ChainedScheduler([sched, lr_scheduler.ExponentialLR(opt, 0.9)])

        def step(loop, batch):
            out = train_step(loop, batch)
            if by_hand:
                sched.step()
            return out

        loop = hookfit.Loop(step, TRAIN, val_step=val_step, val_data=VALID, model=m, optimizers=opt,
                            max_epochs=epochs, max_steps=max_steps, run_dir=tmp_path / str(len(list(tmp_path.iterdir()))),
                            val_every_n_steps=2 if plateau else None,
                            plugins=[Metrics(), Optim(schedulers=sched, **options)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loop.fit()
        return [f"{w.filename.rsplit('/', 1)[-1]}: {w.message}" for w in caught if "scheduler" in str(w.message)]

    assert fit(by_hand=True) == [  # told at the second optimizer step, the first that shows it
        "test_schedulers.py: optim: the LambdaLR of optimizer 'default' stepped 2 times in the first 2 batches of the "
        "training stage of epoch 1, and optim stepped it 1 times: something else steps it too (scheduler.step() in the "
        "step function?), "
        "so its schedule runs ahead of the optimizer's steps. optim steps the schedulers given to "
        "Optim(schedulers=...): remove the other step() call, or leave the scheduler out of Optim"]
    inside = fit(by_hand=True, epochs=1, max_steps=3, accumulate=4)  # the run ends before optim's first step
    assert [m.split(":")[2].split(", and")[0] for m in inside if "optim:" in m] == [
        " the LambdaLR of optimizer 'default' stepped 3 times in the training stage of epoch 1"]  # at its end
    early = fit(by_hand=True, epochs=1, accumulate=4)  # the first optimizer step shows the 3 steps before it
    assert [m.split(":")[2].split(": something")[0] for m in early if "optim:" in m] == [
        " the LambdaLR of optimizer 'default' stepped 3 times in the first 4 batches of the training stage of epoch 1, "
        "and optim stepped it 0 times"]
    assert len(fit(by_hand=True, chain=True)) == 1 and fit(by_hand=False, chain=True) == []
    assert fit(by_hand=False) == [] and fit(by_hand=False, accumulate=2) == []
    assert fit(by_hand=False, epochs=1, max_steps=4, scheduler_interval="epoch") == []
    assert fit(by_hand=False, scheduler_interval="epoch") == []
    assert fit(by_hand=False, plateau=True, monitor="valid/loss") == []


def test_a_run_resumed_at_an_epoch_s_end_steps_its_epoch_scheduler_without_torch_s_order_warning(tmp_path) -> None:
    """Stopped on an epoch's last batch, the resumed run steps an epoch-wise scheduler before this process's first
    optimizer step with no torch warning "lr_scheduler.step() before optimizer.step()" (the run had stepped it)."""
    import warnings

    def fit(run_dir, stop=None, resume=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
        plugins = [Checkpoint(background=False), *([stop] if stop else []),
                   Optim(schedulers=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), scheduler_interval="epoch")]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hookfit.Loop(mse_step, data, model=model, optimizers=opt, max_epochs=3, run_dir=run_dir, resume=resume,
                         plugins=plugins).fit()
        return model.weight.detach().clone(), [str(w.message) for w in caught]

    straight, _ = fit(tmp_path / "straight")
    fit(tmp_path / "run", stop=StopAfter(4))  # the first epoch's last batch
    resumed, said = fit(tmp_path / "run", resume="latest")
    assert not [m for m in said if "lr_scheduler.step()" in m], said
    assert torch.equal(resumed, straight)


def test_an_epoch_scheduler_leaves_a_warning_shown_once_shown_once() -> None:
    """Stepping epoch-wise schedulers under warnings.catch_warnings cleared every warning registry each
    epoch: a warning the 'default' filter shows once was shown again every epoch."""
    import warnings

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(loop, batch):
        warnings.warn("from the step", UserWarning)
        return mse_step(loop, batch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        hookfit.Loop(step, [(torch.randn(8, 4), torch.randn(8, 1))] * 2, model=model, optimizers=opt, max_epochs=3,
                     plugins=[Optim(schedulers=torch.optim.lr_scheduler.StepLR(opt, 1), scheduler_interval="epoch")]
                     ).fit()
    assert [str(w.message) for w in caught].count("from the step") == 1


def test_a_per_step_scheduler_that_passes_its_schedule_in_the_first_epoch_is_told_to_step_each_epoch() -> None:
    """A schedule ported from a loop that steps it once an epoch (pytorch/examples: StepLR(step_size=30) for
    ImageNet, StepLR(step_size=1, gamma=0.7) for MNIST) stepped after each optimizer step instead: one warning at
    the script's fit() line, naming scheduler_interval='epoch'. Schedules counted in steps (OneCycleLR,
    CosineAnnealingLR over the run's steps, a decay spread over it, milestones past the first epoch), and the same
    schedules stepped each epoch, say nothing."""
    import warnings

    def fit(make, epochs: int = 3, batches: int = 6, max_steps: int | None = None,
            **options) -> list[warnings.WarningMessage]:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loop = hookfit.Loop(train_step, data(batches), model=m, optimizers=opt, max_epochs=epochs,
                            max_steps=max_steps, plugins=[Optim(schedulers=make(opt), **options)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loop.fit()
        return [w for w in caught if "looks counted in epochs" in str(w.message)]

    told = fit(lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.1))
    assert [str(w.message) for w in told] == [
        "optim: the StepLR of optimizer 'default' steps after each optimizer step and passes its schedule within the "
        "first epoch (6 steps): it looks counted in epochs. Give Optim(scheduler_interval='epoch') to step it at each "
        "epoch's end, or count it in optimizer steps"]
    assert told[0].category is OptimWarning and told[0].filename == __file__  # the fit() line
    assert len(fit(lambda opt: lr_scheduler.StepLR(opt, step_size=30, gamma=0.1), batches=120)) == 1
    assert len(fit(lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.1))) == 1
    assert len(fit(lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.3))) == 1
    assert fit(lambda opt: lr_scheduler.MultiStepLR(opt, [2, 4]), accumulate=3) == []  # 2 steps an epoch
    for make in [lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=18),
                 lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=18),
                 lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),  # a decay over the run's steps
                 lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.9),
                 lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[8, 14], gamma=0.1)]:
        assert fit(make) == []
    assert fit(lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.1), scheduler_interval="epoch") == []
    assert fit(lambda opt: lr_scheduler.MultiStepLR(opt, [2, 4]), max_steps=4) == []  # the run ends before


def told(make) -> list[str]:
    """The "looks counted in epochs" warnings of a run of 3 epochs of 6 steps with the scheduler ``make(opt)`` makes."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(train_step, data(6), model=m, optimizers=opt, max_epochs=3,
                     plugins=[Optim(schedulers=make(opt))]).fit()
    return [str(w.message) for w in caught if "looks counted in epochs" in str(w.message)]


def test_lambda_chained_and_sequential_schedules_counted_in_epochs_are_told_to_step_each_epoch() -> None:
    """The warning above is given for a LambdaLR whose factor falls below a thousandth within the first epoch (a
    decay written per epoch), and for a ChainedScheduler or SequentialLR with such a scheduler inside (a
    SequentialLR's each from its milestone). A lambda counted in steps, a warm-up then a cosine over the run's
    steps, say nothing, and a lambda that raises where it is asked is not judged."""
    from hookfit.plugins.support.schedules import passing

    said = told(lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: 0.1 ** epoch))
    assert len(said) == 1 and said[0].startswith("optim: the LambdaLR of optimizer 'default' steps after each"), said
    assert len(told(lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: max(0.0, 1 - epoch / 3)))) == 1
    assert len(told(lambda opt: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2), lr_scheduler.ExponentialLR(opt, gamma=0.3)]))) == 1
    assert len(told(lambda opt: lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.5, total_iters=2),
                                                                 lr_scheduler.StepLR(opt, 1, gamma=0.1)], [2]))) == 1
    assert told(lambda opt: lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / 18))) == []
    assert told(lambda opt: lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.5, total_iters=3),
                                                            lr_scheduler.CosineAnnealingLR(opt, T_max=15)], [3])) == []
    assert told(lambda opt: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2), lr_scheduler.ExponentialLR(opt, gamma=0.9)])) == []
    table = [1.0, 0.5, 0.1]
    raising = lr_scheduler.LambdaLR(torch.optim.SGD(model().parameters(), lr=0.1), lambda epoch: table[epoch])
    assert passing(raising, 6) is None


def test_a_lambda_schedule_is_judged_as_its_scheduler_is_and_a_chain_names_the_scheduler_inside_it() -> None:
    """A cosine written as a LambdaLR that ends at the first epoch's last step (6 steps) says nothing, as
    CosineAnnealingLR(T_max=6) does not; one that ends a step earlier is told, as CosineAnnealingLR(T_max=5) is. The
    warning of a ChainedScheduler or SequentialLR names the scheduler inside it that passes its schedule."""
    import math

    for period, warned in ((6, False), (5, True)):
        assert bool(told(lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=period))) is warned, period
        assert bool(told(lambda opt: lr_scheduler.LambdaLR(
            opt, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, period) / period))))) is warned, period
    said = told(lambda opt: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2), lr_scheduler.ExponentialLR(opt, gamma=0.3)]))
    assert len(said) == 1 and said[0].startswith(
        "optim: the ChainedScheduler (its ExponentialLR) of optimizer 'default' steps after each optimizer step"), said
    said = told(lambda opt: lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.5, total_iters=2),
                                                            lr_scheduler.StepLR(opt, 1, gamma=0.1)], [2]))
    assert len(said) == 1 and said[0].startswith("optim: the SequentialLR (its StepLR) of optimizer 'default'"), said
    said = told(lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.1))
    assert len(said) == 1 and said[0].startswith("optim: the StepLR of optimizer 'default' steps"), said


def test_a_step_schedule_of_a_run_of_one_epoch_is_not_taken_for_one_counted_in_epochs() -> None:
    """MultiStepLR([60, 80]) counted in steps over a run that max_steps=100 ends inside its first (200-batch)
    epoch: no second epoch comes, so nothing says it looks counted in epochs (stepping it each epoch would stop it)."""
    import warnings

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hookfit.Loop(train_step, data(200), model=m, optimizers=opt, max_steps=100,
                     plugins=[Optim(schedulers=lr_scheduler.MultiStepLR(opt, [60, 80]))]).fit()
    assert not [w for w in caught if "counted in epochs" in str(w.message)], [str(w.message) for w in caught]


def test_a_per_step_cosine_schedule_counted_in_epochs_is_told_to_step_each_epoch() -> None:
    """CosineAnnealingLR(T_max=<epochs>) stepped after each optimizer step goes round its cosine several times an
    epoch: T_max passed within the first epoch, one warning names scheduler_interval='epoch'."""
    import warnings

    def told(t_max: int, **options) -> list[str]:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hookfit.Loop(train_step, data(6), model=m, optimizers=opt, max_epochs=5,
                         plugins=[Optim(schedulers=lr_scheduler.CosineAnnealingLR(opt, T_max=t_max), **options)]).fit()
        return [str(w.message) for w in caught if "looks counted in epochs" in str(w.message)]

    assert len(told(5)) == 1 and "the CosineAnnealingLR of optimizer 'default'" in told(5)[0]
    assert told(30) == [] and told(6) == [] and told(5, scheduler_interval="epoch") == []


@pytest.mark.bad_input
@pytest.mark.parametrize("total_steps, options, takes", [
    (9, {"accumulate": 3}, 12),  # 4 steps an epoch (windows of 3, 3, 3 and 1), 3 epochs
    (4, {"max_steps": 14, "accumulate": 3}, 5),  # 4 steps in the first epoch, 1 whole window of 4 batches after
])
def test_a_onecycle_schedule_shorter_than_the_run_is_warned_of_when_the_run_starts(total_steps, options, takes) -> None:
    """Torch raised "Tried to step 13 times" mid-run; the numbers and the fix are said at the start. A warning, not
    an error: a step function may step the optimizer less often than every window (a GAN's generator)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    max_steps = options.pop("max_steps", None)
    sched = lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=total_steps)
    with pytest.warns(OptimWarning, match=rf"optim: the OneCycleLR of optimizer 'default' has total_steps={total_steps}, "
                                          rf"and this run takes {takes} optimizer steps if it steps at every window "
                                          rf".*build it with total_steps={takes}"):
        with pytest.raises(ValueError, match="Tried to step"):  # torch's, once it runs out
            hookfit.Loop(train_step, data(10), model=m, optimizers=opt, max_epochs=3, max_steps=max_steps,
                         plugins=[Optim(schedulers=sched, **options)]).fit()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=takes)  # exactly the run's steps: nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        assert hookfit.Loop(train_step, data(10), model=m, optimizers=opt, max_epochs=3, max_steps=max_steps,
                            plugins=[Optim(schedulers=sched, **options)]).fit().status == "completed"
    assert sched.last_epoch == takes


def test_a_onecycle_schedule_of_an_optimizer_stepped_every_second_batch_runs_whole() -> None:
    """A generator stepped every second batch, its OneCycleLR built for that: warned of (the run cannot know the
    step function's cadence at its start), and it runs to its end; it was refused."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=15)

    def every_second(loop, batch):
        loss = torch.nn.functional.mse_loss(loop.model(batch[0]), batch[1])
        loop.backward(loss)
        if loop.state.batch_idx % 2:
            loop.optimizers.step()
            loop.optimizers.zero_grad()
        return loss

    with pytest.warns(OptimWarning, match="if it steps at every window"):
        state = hookfit.Loop(every_second, data(10), model=m, optimizers=opt, max_epochs=3,
                             plugins=[Optim(schedulers=sched)]).fit()
    assert state.status == "completed" and sched.last_epoch == 15


class Endless:
    """Training data without a len(): the same batches again and again."""

    def __iter__(self):
        while True:
            yield from data(10)


def sized(make, accumulate: int = 4, train=None, **limits) -> tuple[list[warnings.WarningMessage], int, object]:
    """A real run of 3 epochs of 10 batches (unless ``train`` and ``limits`` say) under Optim(accumulate=...) with
    the scheduler ``make(opt)`` makes: the warnings that a schedule is sized to the batches, the optimizer steps
    the run took (torch's own count), and the scheduler."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    stepped = []
    opt.register_step_post_hook(lambda *args: stepped.append(1))
    sched = make(opt)
    loop = hookfit.Loop(train_step, data(10) if train is None else train, model=m, optimizers=opt,
                        **{"max_epochs": 3, **limits}, plugins=[Optim(accumulate=accumulate, schedulers=sched)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loop.fit().status == "completed"
    return [w for w in caught if "counts optimizer steps" in str(w.message)], len(stepped), sched


TAIL = (" A scheduler stepped after each optimizer step counts optimizer steps: size its schedule to them")


@pytest.mark.bad_input
@pytest.mark.parametrize("make, limits, said", [
    (lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=30), {},
     "the CosineAnnealingLR of optimizer 'default' has T_max=30, as many as the batches this run trains, and would "
     "run only 9 of those steps: give T_max=9 (accumulate=4: the optimizers step 9 times in the run's 30 batches, 3 "
     "an epoch of 10)."),  # windows of 4, 4 and 2 an epoch
    (lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=26), {"max_steps": 26},
     "the OneCycleLR of optimizer 'default' has total_steps=26, as many as max_steps, and would run only 7 of those "
     "steps: give total_steps=7 (accumulate=4: the optimizers step 7 times in the run's 26 batches, 3 an epoch of "
     "10)."),  # 3 and 3, then one whole window of the 6 batches max_steps leaves of the third epoch
    (lambda opt: lr_scheduler.LinearLR(opt, 1.0, 0.01, total_iters=30), {},
     "the LinearLR of optimizer 'default' has total_iters=30, as many as the batches this run trains, and would run "
     "only 9 of those steps: give total_iters=9"),
    (lambda opt: lr_scheduler.PolynomialLR(opt, total_iters=30, power=2.0), {},
     "the PolynomialLR of optimizer 'default' has total_iters=30, as many as the batches this run trains, and would "
     "run only 9 of those steps: give total_iters=9"),
    (lambda opt: lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.1, total_iters=2),
                                                 lr_scheduler.CosineAnnealingLR(opt, T_max=28)], [2]), {},
     "the SequentialLR's CosineAnnealingLR of optimizer 'default' has T_max=28 from its milestone 2 (to step 30), as "
     "many as the batches this run trains, and would run only 7 of those steps: give T_max=7"),
    (lambda opt: lr_scheduler.ChainedScheduler([lr_scheduler.PolynomialLR(opt, total_iters=30),
                                                lr_scheduler.ConstantLR(opt, 0.5, total_iters=3)]), {},
     "the ChainedScheduler's PolynomialLR of optimizer 'default' has total_iters=30, as many as the batches this run "
     "trains, and would run only 9 of those steps: give total_iters=9"),
    (lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=20), {"max_steps": 20, "train": Endless()},
     "the CosineAnnealingLR of optimizer 'default' has T_max=20, as many as max_steps, and would run only 5 of those "
     "steps: give T_max=5 (accumulate=4: the optimizers step 5 times in the run's 20 batches, or more where an epoch "
     "of data without a len() ends inside a window)."),
], ids=["CosineAnnealingLR", "OneCycleLR-max_steps", "LinearLR", "PolynomialLR", "SequentialLR", "ChainedScheduler",
        "no-len"])
def test_a_per_step_schedule_sized_to_the_batches_under_accumulation_is_told_the_optimizer_steps(make, limits,
                                                                                                  said) -> None:
    """CosineAnnealingLR(T_max=max_steps) with accumulate=4 ran a quarter of its cosine and said nothing: max_steps
    counts batches, the scheduler optimizer steps. One warning at the fit() line, when the run starts, names the
    scheduler, its attribute, the batches and the optimizer steps the run then takes, which is the fix."""
    told, steps, _ = sized(make, **limits)
    assert len(told) == 1 and told[0].category is OptimWarning and told[0].filename == __file__, told
    message = str(told[0].message)
    assert message.startswith(f"optim: {said}") and message.endswith(TAIL), message
    assert f"the optimizers step {steps} times" in message, (message, steps)  # the steps torch took


def test_a_schedule_sized_to_the_optimizer_steps_or_any_other_length_or_without_accumulation_says_nothing() -> None:
    """Only a schedule exactly as long as the batches is told: one sized to the optimizer steps runs to its end, and
    one a step longer, a run without accumulation and a scheduler stepped each epoch are taken as meant."""
    told, steps, sched = sized(lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=9))
    assert told == [] and steps == 9 and sched.last_epoch == 9 and sched.get_last_lr() == [0.0]  # its whole cosine
    assert sized(lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=31))[0] == []
    told, steps, _ = sized(lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=30), accumulate=1)
    assert told == [] and steps == 30
    assert sized(lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=7), max_steps=26)[0] == []
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimWarning)
        hookfit.Loop(train_step, data(10), model=m, optimizers=opt, max_epochs=3, plugins=[Optim(
            accumulate=4, schedulers=lr_scheduler.LinearLR(opt, total_iters=30), scheduler_interval="epoch")]).fit()


def hf_linear(warmup: int, total: int):
    """Hugging Face's get_linear_schedule_with_warmup lambda: a warmup, then linear to 0 at step ``total``."""
    return lambda step: (step + 1) / warmup if step < warmup else max(0.0, (total - step) / max(1, total - warmup))


@pytest.mark.bad_input
@pytest.mark.parametrize("make, limits, said", [
    (lambda opt: lr_scheduler.LambdaLR(opt, hf_linear(4, 26)), {"max_steps": 26},
     "the LambdaLR of optimizer 'default' reaches its end (a factor of 0) at step 26, as many as max_steps, and "
     "would run only 7 of those steps: size its lambda to 7 steps (accumulate=4: the optimizers step 7 times in the "
     "run's 26 batches, 3 an epoch of 10)."),
    (lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / 30))), {},
     "the LambdaLR of optimizer 'default' reaches its end (a factor of 0) at step 30, as many as the batches this "
     "run trains, and would run only 9 of those steps: size its lambda to 9 steps"),  # a cosine, back up after
    (lambda opt: lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, 0.1, total_iters=2), lr_scheduler.LambdaLR(
        opt, lambda s: max(0.0, 1 - s / 28))], [2]), {},
     "the SequentialLR's LambdaLR of optimizer 'default' reaches its end (a factor of 0) at step 30 (28 steps from "
     "its milestone 2), as many as the batches this run trains, and would run only 7 of those steps: size its "
     "lambda to 7 steps"),
    (lambda opt: lr_scheduler.MultiplicativeLR(opt, lambda s: 0.01 ** (1 / 30) if s <= 30 else 1.0), {},
     "the MultiplicativeLR of optimizer 'default' reaches its end (a factor of 0.01) at step 30, as many as the "
     "batches this run trains, and would run only 9 of those steps: size its lambda to 9 steps"),  # a factor a step
], ids=["hf-linear-max_steps", "cosine", "SequentialLR", "MultiplicativeLR"])
def test_a_lambda_schedule_ending_at_the_batches_under_accumulation_is_told_the_optimizer_steps(make, limits,
                                                                                               said) -> None:
    """Hugging Face's linear warmup schedule (a LambdaLR) sized to max_steps under accumulate=4 took a quarter of
    its steps and ended at 0.83 of the peak rate with no word, where CosineAnnealingLR(T_max=max_steps) was told:
    the lambda, probed at fit_start, reaches its end value at the batches, and the run steps it fewer times. A
    MultiplicativeLR's lambda is a factor on the step before: the product of its factors is probed alike."""
    told, steps, sched = sized(make, **limits)
    assert len(told) == 1 and told[0].category is OptimWarning and told[0].filename == __file__, told
    message = str(told[0].message)
    assert message.startswith(f"optim: {said}") and message.endswith(TAIL), message
    assert f"the optimizers step {steps} times" in message and sched.last_epoch == steps, (message, steps)


def test_a_lambda_schedule_sized_to_the_optimizer_steps_constant_or_warmup_only_or_without_accumulation_says_nothing(
        ) -> None:
    """Only a lambda that reaches its end exactly at the batches the run trains, where the run steps it fewer times,
    is told: one sized to the optimizer steps runs to its end; a constant, a warmup that then holds, a decay that
    goes on, a lambda that raises or gives no number, and a run without accumulation are not; nor a MultiplicativeLR
    whose factor is constant (1.0: none; 0.95: a decay that goes on) or whose product ends at the optimizer steps."""
    told, steps, sched = sized(lambda opt: lr_scheduler.LambdaLR(opt, hf_linear(2, 9)))
    assert told == [] and steps == 9 and sched.get_last_lr() == [0.0]  # it ran to its end
    for f in [lambda s: 1.0, lambda s: min(1.0, (s + 1) / 4), lambda s: 0.9 ** s, lambda s: 1 / math.sqrt(s + 1),
              lambda s: 1 - s / 30 if s < 30 else 1 / 0, lambda s: "0.5" if s > 40 else max(0.0, 1 - s / 30)]:
        assert sized(lambda opt: lr_scheduler.LambdaLR(opt, f))[0] == []
    assert sized(lambda opt: lr_scheduler.LambdaLR(opt, hf_linear(4, 30)), accumulate=1)[0] == []
    for f in [lambda s: 1.0, lambda s: 0.95]:
        assert sized(lambda opt: lr_scheduler.MultiplicativeLR(opt, f))[0] == []
    told, steps, sched = sized(lambda opt: lr_scheduler.MultiplicativeLR(opt, lambda s: 0.01 ** (1 / 9) if s <= 9
                                                                          else 1.0))
    assert told == [] and steps == 9 and sched.get_last_lr() == [pytest.approx(0.1 * 0.01)]  # it ran to its end


class Published:
    """Each publication's rate beside the rate of the latest step before it (``before_optimizer_step``'s read,
    the initial rate before any) and the group's rate at the publication."""

    name = "published"

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.used, self.seen = opt, [], []

    def _seen(self, stage, metrics) -> None:
        used = self.used[-1] if self.used else 0.1
        self.seen.append((stage, metrics.final, metrics.lr["default"], used, self.opt.param_groups[0]["lr"]))

    @hookfit.hookimpl
    def before_optimizer_step(self, optimizer):
        self.used.append(optimizer.param_groups[0]["lr"])

    @hookfit.hookimpl
    def metrics_update(self, metrics):
        self._seen(metrics.stage, metrics)

    @hookfit.hookimpl
    def epoch_metrics(self, stage, metrics):
        self._seen(stage, metrics)


@pytest.mark.parametrize("kind", ["step", "step, accumulate=2", "epoch", "plateau"])
def test_the_published_rate_is_the_rate_of_the_latest_step(kind: str) -> None:
    """MetricsSnapshot.lr is the rate the optimizer's latest step used, as Lightning's LearningRateMonitor logs:
    a batch's row its own step's (not the next step's, which its scheduler set after it), an epoch's its last
    step's, its validation's rows too; with an epoch-wise scheduler or a plateau, the epoch's steps'."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if kind == "plateau":  # (never an improvement past the first epoch: halved after each later one)
        sched = lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0, threshold_mode="abs")
        options = {"schedulers": sched, "monitor": "train/loss"}
    else:
        options = {"schedulers": lr_scheduler.StepLR(opt, 1, gamma=0.5), "accumulate": 1 + kind.endswith("2"),
                   "scheduler_interval": "epoch" if kind == "epoch" else None}
    published = Published(opt)
    hookfit.Loop(train_step, data(3), val_step=val_step, val_data=VALID, model=m, optimizers=opt, max_epochs=3,
                 disable=["console"], plugins=[Optim(**options), Metrics(interval=0), published]).fit()
    assert len(set(published.used)) > 1  # the schedule changed the rate
    assert [(stage, final) for stage, final, *_ in published.seen].count(("valid", False)) == 9  # every batch
    assert [lr for *_, lr, _, _ in published.seen] == pytest.approx([used for *_, used, _ in published.seen])
    # the group's rate is another at times, but where the scheduler steps after all its epoch's publications
    assert any(now != used for *_, used, now in published.seen) is (kind != "epoch")


def test_a_run_resumed_inside_a_window_publishes_the_rates_of_the_uninterrupted_one(tmp_path) -> None:
    """The rate of the latest step is in the checkpoint: a run stopped after a window's step and resumed publishes,
    for the next window's batches, the rate that step used (not the one its scheduler set since)."""
    def run(folder, stop=None, resume=None):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        published = Published(opt)
        plugins = [Optim(accumulate=2, schedulers=lr_scheduler.StepLR(opt, 1, gamma=0.5)), Metrics(interval=0),
                   Checkpoint(background=False), published, *([StopAfter(stop)] if stop else [])]
        hookfit.Loop(train_step, TRAIN, model=m, optimizers=opt, max_epochs=2, run_dir=folder, resume=resume,
                     disable=["console"], plugins=plugins).fit()
        return [lr for _, final, lr, *_ in published.seen if not final]

    whole = run(tmp_path / "whole")
    run(tmp_path / "split", stop=2)  # after the first window's step
    assert run(tmp_path / "split", resume="latest") == whole[2:] and whole[:4] == [0.1, 0.1, 0.1, 0.05]


@pytest.mark.bad_input
def test_a_one_set_monitor_with_several_sets_is_refused_at_configure_naming_each_set_s_name() -> None:
    """``valid/loss`` where the sets publish ``valid/a/loss`` and ``valid/b/loss``: refused before the first
    batch, not after the first validation."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    steps = []
    loop = hookfit.Loop(lambda loop, b: steps.append(train_step(loop, b)), TRAIN, val_step=val_step,
                        val_data={"a": VALID, "b": VALID}, model=m, optimizers=opt,
                        plugins=[Optim(schedulers=lr_scheduler.ReduceLROnPlateau(opt), monitor="valid/loss"),
                                 Metrics()])
    with pytest.raises(ValueError, match=r"^optim: monitor='valid/loss' names no validation set, and this run "
                                         r"validates 2 sets \('a', 'b'\), whose metrics are named per set "
                                         r"\('valid/<set>/<metric>'\): give monitor='valid/a/loss' or 'valid/b/loss'"
                                         r"\n"):
        loop.fit()
    assert steps == []
