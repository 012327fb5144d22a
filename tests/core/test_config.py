"""hookfit.config: discovered plugins take their options from hookfit.toml, without code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hookfit
from hookfit import config
from hookfit.config import ConfigError
from hookfit.plugins.early_stopping import EarlyStopping


SCRIPT = '''
import torch, hookfit

def step(loop, batch):
    return {"loss": torch.tensor(1.0)}

def valid(loop, batch):  # never improves after the first epoch
    return {"loss": torch.tensor(1.0 + loop.state.epoch)}

loop = hookfit.Loop(step, [1, 2], val_step=valid, val_data=[1], max_epochs=20)
state = loop.fit()
print("STOP", state.status, state.step, state.stop_reason)
print("CHECKPOINT", loop.run.pm.get_plugin("checkpoint").every_n_steps)
'''


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    return {**base, "HOOKFIT_PLUGINS": "metrics,early_stopping,checkpoint", **extra}


@pytest.mark.slow
def test_a_script_s_discovered_plugins_take_their_options_from_the_file_next_to_it(tmp_path: Path) -> None:
    """The script does not change: the file next to it configures early stopping and
    checkpoints; HOOKFIT_CONFIG names another file instead."""
    script = write(tmp_path / "project" / "train.py", SCRIPT)
    write(tmp_path / "project" / "hookfit.toml", """
        [plugins.early_stopping]
        monitor = "valid/loss"
        patience = 2

        [plugins.checkpoint]
        every_n_steps = 500
    """)
    write(tmp_path / "other.toml", """
        [plugins.early_stopping]
        monitor = "valid/loss"
        patience = 4
    """)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("STOP completed 6 early stopping: valid/loss did not improve for 2 epoch(s) (patience 2); "
            "best (min) 1 at epoch 1") in done.stdout
    assert "CHECKPOINT 500" in done.stdout
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env(HOOKFIT_CONFIG=str(tmp_path / "other.toml")))
    assert done.returncode == 0, done.stderr
    assert "STOP completed 10 early stopping: valid/loss did not improve for 4 epoch(s)" in done.stdout
    assert "CHECKPOINT None" in done.stdout  # that file does not configure checkpoints


@pytest.mark.slow
def test_a_run_and_the_listing_read_the_same_file_by_one_rule(tmp_path: Path) -> None:
    """From a project root with scripts/train.py: the run reads the root's hookfit.toml when
    the script's folder has none, as ``hookfit plugins`` started there lists; once the
    script's folder has its own, the run reads that one, as ``hookfit plugins --script``."""
    root = tmp_path / "project"
    script = write(root / "scripts" / "train.py", SCRIPT)
    write(root / "hookfit.toml", "[plugins.checkpoint]\nevery_n_steps = 300\n")

    def listed(*args: str) -> object:
        done = subprocess.run([sys.executable, "-m", "hookfit", "plugins", "--json", *args], cwd=root, env=env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        row = next(r for r in json.loads(done.stdout) if r["name"] == "checkpoint")
        return row["options"]["every_n_steps"]["value"]

    def ran() -> str:
        done = subprocess.run([sys.executable, str(script.relative_to(root))], cwd=root, env=env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "CHECKPOINT 300" in ran() and listed() == 300 == listed("--script", "scripts/train.py")
    write(root / "scripts" / "hookfit.toml", "[plugins.checkpoint]\nevery_n_steps = 700\n")
    assert "CHECKPOINT 700" in ran() and listed("--script", "scripts/train.py") == 700


@pytest.mark.slow
def test_hookfit_plugins_shows_each_plugin_s_options_and_where_they_come_from(tmp_path: Path) -> None:
    write(tmp_path / "hookfit.toml", """
        [plugins.early_stopping]
        monitor = "valid/loss"
        patience = 5
    """)
    done = subprocess.run([sys.executable, "-m", "hookfit", "plugins"], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(f"options file: {tmp_path / 'hookfit.toml'} (")  # which one
    assert ("    options: monitor='valid/loss' (hookfit.toml), mode=None, patience=5 (hookfit.toml), "
            "min_delta=0.0") in done.stdout.splitlines()
    done = subprocess.run([sys.executable, "-m", "hookfit", "plugins", "--json"], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=120)
    (row,) = [r for r in json.loads(done.stdout) if r["name"] == "early_stopping"]
    assert row["options"]["patience"] == {"value": 5, "from": "file"}
    assert row["options"]["mode"] == {"value": None, "from": "default"}  # the metrics plugin's direction

    write(tmp_path / "hookfit.toml", "[plugins.early_stoping]\npatience = 5\n")
    done = subprocess.run([sys.executable, "-m", "hookfit", "plugins"], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "did you mean 'early_stopping'" in done.stderr, done.stderr


GIVEN_IN_CODE = '''
import warnings, torch, hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim
warnings.simplefilter("error", hookfit.HookfitWarning)  # the file's options are used: nothing to warn of
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))  # not for a TOML file
optim, checkpoint = Optim(schedulers=sched), Checkpoint(monitor="valid/loss")

def step(loop, batch):
    loss = torch.nn.functional.mse_loss(loop.model(batch), batch.sum(1, keepdim=True))
    loop.backward(loss); loop.optimizers.step(); loop.optimizers.zero_grad()
    return {"loss": loss}

loop = hookfit.Loop(step, [torch.randn(4, 2) for _ in range(8)], val_step=lambda l, b: {"loss": 1.0}, val_data=[1],
                    model=model, optimizers=opt, max_epochs=3, run_dir="run", plugins=[optim, checkpoint])
loop.fit()
used = loop.run.pm.get_plugin("optim")
print("OPTIM", used is optim, used.accumulate, used.clip_norm, used.precision, used.schedulers is sched)
print("STEPS", sched.last_epoch)
kept = loop.run.pm.get_plugin("checkpoint")
print("CHECKPOINT", kept is checkpoint, kept.monitor, kept.keep_last, len(list((loop.run_dir / "checkpoints").glob("*.pt"))))
'''


@pytest.mark.slow
def test_a_plugin_given_in_code_takes_the_options_its_code_does_not_pass_from_the_file(tmp_path: Path) -> None:
    """The script gives Optim its scheduler (no TOML can) and Checkpoint its monitor; the file next to it
    gives their other options: the run uses both, on the objects given, without a warning; ``hookfit plugins
    --script`` lists the file's options as the run's, saying that an option the script passes in code wins."""
    script = write(tmp_path / "project" / "train.py", GIVEN_IN_CODE)
    write(tmp_path / "project" / "hookfit.toml", """
        [plugins.optim]
        accumulate = 4
        clip_norm = 1.0
        precision = "bf16-mixed"

        [plugins.checkpoint]
        keep_last = 1
    """)
    chosen = {**env(), "HOOKFIT_PLUGINS": "metrics,optim,checkpoint"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=chosen)
    assert done.returncode == 0, done.stderr
    assert "OPTIM True 4 1.0 bf16-mixed True" in done.stdout, done.stdout
    assert "STEPS 6" in done.stdout  # 24 batches, 4 to a step
    assert "CHECKPOINT True valid/loss 1 2" in done.stdout, done.stdout  # of 3 epochs': the last and the best

    listed = subprocess.run([sys.executable, "-m", "hookfit", "plugins", "--script", str(script)], cwd=tmp_path,
                            env=chosen, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == (f"options file: {tmp_path / 'project' / 'hookfit.toml'} (the options listed are a run's, "
                        f"but those its script passes to the plugin in code)")
    start = next(i for i, line in enumerate(lines) if line.startswith("optim  "))
    optim = next(line for line in lines[start:] if line.startswith("    options: "))
    assert optim.startswith("    options: accumulate=4 (hookfit.toml), clip_norm=1.0 (hookfit.toml),"), optim
    assert "precision='bf16-mixed' (hookfit.toml)" in optim, optim


# -- in this process: HOOKFIT_CONFIG names the file -----------------------------------------


@pytest.fixture
def configure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a configuration file and point HOOKFIT_CONFIG at it; discover two built-ins."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,early_stopping")

    def configure(text: str) -> Path:
        path = write(tmp_path / "run.toml", text)
        monkeypatch.setenv("HOOKFIT_CONFIG", str(path))
        return path

    return configure


def fit(**kwargs) -> hookfit.Loop:
    loop = hookfit.Loop(lambda l, b: {"loss": torch.tensor(1.0)}, [1], val_step=lambda l, b: {"loss": 1.0},
                        val_data=[1], max_epochs=5, **kwargs)
    loop.fit()
    return loop


@pytest.mark.bad_input
@pytest.mark.parametrize("text, message", [
    ("[plugins.early_stoping]\npatience = 2\n",
     r"run.toml \[plugins.early_stoping\]: no plugin named 'early_stoping' is installed or given \(did you mean "
     r"'early_stopping'\?\); known plugins: .*early_stopping.*metrics"),
    ("[plugins.csv_log]\n",  # the module's name (hookfit.plugins.csv_log), not the plugin's
     r"run.toml \[plugins.csv_log\]: no plugin named 'csv_log' is installed or given \(did you mean 'csv'\?\)"),
    ("[plugins.early_stopping]\npatience = 2\nwait = 3\n",
     r"run.toml \[plugins.early_stopping\]: plugin 'early_stopping' has no option 'wait'; its options are: "
     r"monitor, mode, patience, min_delta"),
    ("[plugins.early_stopping]\npatience = -2\n",
     r"run.toml \[plugins.early_stopping\]: early_stopping: patience must be an integer >= 0 \(epochs\), got -2"),
    ("[plugins.early_stopping]\npatience = 2\n[plugins.early_stopping.x]\n",
     r"run.toml \[plugins.early_stopping\]: plugin 'early_stopping' has no option 'x'"),
    ("[plugins.early_stopping\npatience = 2\n", r"run.toml: not valid TOML: .*line 1"),
    ("[loop]\nmax_epochs = 3\n", r"run.toml: unknown table\(s\) 'loop'; the file has one table, \[plugins.<name>\]"),
    ("plugins = 3\n", r"run.toml: 'plugins' must hold one table per plugin"),
])
def test_a_bad_file_is_an_error_naming_the_file_the_plugin_and_what_it_accepts(configure, text: str,
                                                                                message: str) -> None:
    configure(text)
    with pytest.raises(ConfigError, match=message):
        fit()


@pytest.mark.bad_input
def test_a_config_variable_naming_no_file_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match=r"HOOKFIT_CONFIG=.*nope.toml: no such file"):
        fit()


def test_options_reach_the_discovered_plugin(configure) -> None:
    configure('[plugins.early_stopping]\nmonitor = "valid/loss"\npatience = 1\n')
    loop = fit()
    plugin = loop.run.pm.get_plugin("early_stopping")
    assert (plugin.monitor, plugin.patience) == ("valid/loss", 1)
    assert loop.state.step == 2 and loop.state.stopped_by == "early_stopping"


def test_an_option_given_in_code_wins_over_the_file_s_with_a_warning_naming_both(configure) -> None:
    """Option by option: the code's patience=3 is used, not the file's 1 (warned of); the file's mode, which
    the code does not pass, is used, on the very object given."""
    configure('[plugins.early_stopping]\nmonitor = "valid/loss"\npatience = 1\nmode = "max"\n')
    mine = EarlyStopping(monitor="valid/loss", patience=3)
    with pytest.warns(hookfit.HookfitWarning) as caught:
        loop = fit(plugins=[mine])
    (said,) = [str(w.message) for w in caught if "run.toml" in str(w.message)]
    assert said.endswith("run.toml [plugins.early_stopping]: monitor = 'valid/loss', patience = 1 not used: the "
                         "EarlyStopping given to Loop(plugins=[...]) is passed monitor='valid/loss', patience=3 in "
                         "code, which wins over the file (leave it out of the code to take the file's)"), said
    assert loop.run.pm.get_plugin("early_stopping") is mine
    assert (mine.patience, mine.mode) == (3, "max") and loop.state.step == 4  # 1.0 every epoch: max, no better
    assert config.given_options(mine) == {"monitor": "valid/loss", "patience": 3}  # for the next run


def test_an_object_given_to_two_runs_has_the_options_of_each_run_s_file(configure) -> None:
    mine = EarlyStopping(monitor="valid/loss")
    configure('[plugins.early_stopping]\npatience = 1\n')
    assert fit(plugins=[mine]).state.step == 2 and mine.patience == 1
    configure('[plugins.early_stopping]\nmin_delta = 0.5\n')
    assert fit(plugins=[mine]).state.step == 4 and (mine.patience, mine.min_delta) == (3, 0.5)  # the default's
    configure('[plugins.checkpoint]\n')
    assert fit(plugins=[mine]).state.step == 4 and (mine.patience, mine.min_delta) == (3, 0.0)
    assert config.given_options(mine) == {"monitor": "valid/loss"}


def test_a_plugin_given_as_a_class_takes_every_option_of_the_file(configure) -> None:
    configure('[plugins.early_stopping]\nmonitor = "valid/loss"\npatience = 1\n')
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", hookfit.HookfitWarning)
        loop = fit(plugins=[EarlyStopping])
    assert loop.run.pm.get_plugin("early_stopping").patience == 1 and loop.state.step == 2


@pytest.mark.bad_input
def test_a_value_refused_for_a_plugin_given_in_code_names_the_file(configure) -> None:
    from hookfit.plugins.optim import Optim

    configure("[plugins.optim]\naccumulate = 0\n")
    with pytest.raises(ConfigError, match=r"run.toml \[plugins.optim\]: optim: accumulate must be"):
        fit(plugins=[Optim(clip_norm=1.0)])
    configure("[plugins.optim]\naccumulat = 2\n")
    with pytest.raises(ConfigError, match=r"run.toml \[plugins.optim\]: plugin 'optim' has no option 'accumulat'"):
        fit(plugins=[Optim(clip_norm=1.0)])


class Unrecorded:
    """A plugin of another package whose class does not record the arguments it was given."""

    name = "unrecorded"

    def __init__(self, level: int = 1, tag: str = "") -> None:
        self.level, self.tag = level, tag

    @hookfit.hookimpl
    def fit_start(self, loop) -> None:
        pass


@pytest.mark.bad_input
def test_the_table_of_a_plugin_that_does_not_record_its_arguments_is_not_used_with_each_option_named(
        configure) -> None:
    configure('[plugins.unrecorded]\nlevel = 3\ntag = "x"\n')
    mine = Unrecorded(level=2)
    with pytest.warns(hookfit.HookfitWarning) as caught:
        fit(plugins=[mine])
    (said,) = [str(w.message) for w in caught if "run.toml" in str(w.message)]
    assert said.endswith("run.toml [plugins.unrecorded] is not used: the plugin 'unrecorded' (Unrecorded) is given to "
                         "Loop(plugins=[...]) and its class does not record the arguments the code passes it, so the "
                         "file cannot fill in the others; pass them in code, Unrecorded(level=3, tag='x', ...), or "
                         "decorate the class with @hookfit.config.records_options"), said
    assert (mine.level, mine.tag) == (2, "")
    recorded = config.records_options(type("Recorded", (Unrecorded,), {}))
    assert config.given_options(recorded(2, tag="y")) == {"level": 2, "tag": "y"}
    assert config.given_options(recorded()) == {}


def test_a_disabled_plugin_s_options_are_not_used(configure) -> None:
    configure('[plugins.early_stopping]\nmonitor = "valid/nothing"\n')
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop = fit(disable=["early_stopping"])
    assert loop.state.status == "completed" and loop.run.pm.get_plugin("early_stopping") is None


@pytest.mark.bad_input
def test_a_typo_in_a_disabled_built_in_s_table_is_warned_before_the_day_it_is_enabled(configure) -> None:
    configure('[plugins.early_stopping]\nmonitor = "valid/loss"\npatiense = 2\n')
    with pytest.warns(hookfit.HookfitWarning, match=r"\[plugins.early_stopping\]: plugin 'early_stopping' has no "
                      r"option 'patiense'; its options are: monitor, mode, patience, min_delta \(the plugin is "
                      r"disabled in this run; enabled, this fails it\)"):
        loop = fit(disable=["early_stopping"])
    assert loop.state.status == "completed"


@pytest.mark.bad_input
def test_a_plugin_that_is_a_module_takes_no_options(dists: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKFIT_CONFIG", str(write(tmp_path / "c.toml", "[plugins.beta]\nx = 1\n")))
    with pytest.raises(ConfigError, match=r"c.toml \[plugins.beta\]: plugin 'beta' is not a class \(module\) and "
                                          r"takes no options"):
        hookfit.Loop(lambda l, b: None, [1]).fit()


# -- a table turns its plugin on; enabled = false disables it ---------------------


def test_an_empty_table_turns_an_inert_plugin_on(configure, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """csv is inert when merely discovered; an empty [plugins.csv] chooses it (it used to stay off
    without a word), as a [plugins.profile] table does the profiler."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,csv")
    loop = fit(run_dir=tmp_path / "off")
    assert loop.run.pm.get_plugin("csv") is None and not (tmp_path / "off" / "metrics.csv").exists()
    configure("[plugins.csv]\n")
    loop = fit(run_dir=tmp_path / "on")
    assert loop.run.pm.get_plugin("csv") is not None and (tmp_path / "on" / "metrics.csv").is_file()
    assert loop.run.pm.infos["csv"].chosen is True


def test_enabled_false_in_the_file_disables_any_plugin_and_enabled_true_only_names_it(configure) -> None:
    info = configure("[plugins.early_stopping]\nenabled = false\nmonitor = \"valid/nothing\"\n")
    loop = fit()
    assert loop.run.pm.get_plugin("early_stopping") is None
    assert loop.run.pm.infos["early_stopping"].disabled_by == f"{info} [plugins.early_stopping] enabled = false"
    configure("[plugins.early_stopping]\nenabled = true\nmonitor = \"valid/loss\"\npatience = 1\n")
    loop = fit()  # early_stopping takes no `enabled`: it is hookfit's, not passed on
    assert loop.state.stopped_by == "early_stopping"


@pytest.mark.bad_input
def test_enabled_must_be_a_boolean(configure) -> None:
    configure("[plugins.early_stopping]\nenabled = \"no\"\n")
    with pytest.raises(ConfigError,
                       match=r"run.toml \[plugins.early_stopping\]: enabled must be true or false, got 'no'"):
        fit()


@pytest.mark.bad_input
@pytest.mark.parametrize("table, given, needs", [
    ("[plugins.ema]\nvalidate = false\n", None, "without a decay it averages nothing"),
    ("[plugins.early_stopping]\npatience = 2\n", None, "without a monitor it never stops the run"),
    ("", "ema", "without a decay it averages nothing"),
])
def test_a_chosen_plugin_that_would_do_nothing_says_so(configure, monkeypatch, table, given, needs) -> None:
    from hookfit.plugins.ema import EMA

    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,early_stopping,ema")
    configure(table)
    with pytest.warns(hookfit.HookfitWarning, match=needs + ".*inert until given a"):
        fit(plugins=[EMA()] if given else [])


def test_merely_discovered_inert_plugins_say_nothing(configure, monkeypatch) -> None:
    import warnings

    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,early_stopping,ema,csv,profile")
    configure("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit()


def test_a_pyprojects_tool_hookfit_table_is_the_file_where_there_is_no_hookfit_toml(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[tool.hookfit.plugins.early_stopping]`` in the project's pyproject.toml was ignored without a word;
    it configures the run as a hookfit.toml beside it would (which wins), and its errors name its tables.
    A pyproject.toml without the table, or one that does not parse, is another tool's and is not read."""
    monkeypatch.delenv("HOOKFIT_CONFIG", raising=False)
    monkeypatch.setenv("HOOKFIT_PLUGINS", "metrics,early_stopping")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["-c"])
    pyproject = write(tmp_path / "pyproject.toml", """
        [project]
        name = "mine"

        [tool.hookfit.plugins.early_stopping]
        monitor = "valid/loss"
        patience = 7
    """)
    assert config.find() == tmp_path / "pyproject.toml"
    assert config.load(config.find()).plugins == {"early_stopping": {"monitor": "valid/loss", "patience": 7}}
    assert fit().run.pm.get_plugin("early_stopping").patience == 7
    pyproject.write_text(pyproject.read_text() + "wait = 3\n")
    with pytest.raises(ConfigError, match=r"pyproject.toml \[tool.hookfit.plugins.early_stopping\]: plugin "
                                          r"'early_stopping' has no option 'wait'"):
        fit()
    write(tmp_path / "hookfit.toml", "[plugins.early_stopping]\npatience = 2\n")
    assert config.find() == tmp_path / "hookfit.toml"
    (tmp_path / "hookfit.toml").unlink()
    for other in ('[project]\nname = "mine"\n', "[project\n"):
        pyproject.write_text(other)
        assert config.find() is None
    pyproject.write_text("[tool.hookfit.plugins.early_stopping]\npatience = \n")  # ours, and not TOML
    with pytest.raises(ConfigError, match=r"pyproject.toml: not valid TOML"):
        config.find()
    pyproject.write_text('[project]\nname = "mine"\n')
    with pytest.raises(ConfigError, match=r"pyproject.toml: no \[tool.hookfit\] table"):
        config.load(pyproject)  # named by HOOKFIT_CONFIG


def builtin_plugin_classes() -> list[type]:
    from importlib.metadata import entry_points

    return [ep.load() for ep in entry_points(group="hookfit") if ep.value.startswith("hookfit.plugins.")]


@pytest.mark.bad_input
@pytest.mark.parametrize("cls", builtin_plugin_classes(), ids=lambda cls: cls.__name__)
def test_a_misspelt_keyword_to_a_builtin_plugin_names_the_one_it_takes(cls: type) -> None:
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [name for name, p in inspect.signature(cls).parameters.items() if p.kind in kinds]
    if not names:
        with pytest.raises(TypeError, match=rf"^{cls.__name__}\(\) got an unexpected keyword argument 'every'; "
                                            "it takes none$"):
            cls(every=1)
        return
    longest = max(names, key=len)  # the signature seen through the check: the class's own
    misspelt = longest[:2] + longest[3:]  # a letter dropped
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\(\) got an unexpected keyword argument {misspelt!r}; "
                                        rf"did you mean {longest!r}\?$"):
        cls(**{misspelt: 1})


def test_a_recorded_constructor_that_takes_any_keyword_is_not_checked() -> None:
    @config.records_options
    class Open:
        def __init__(self, level: int = 1, **extra: object) -> None:
            self.extra = extra

    assert Open(levl=2).extra == {"levl": 2} and config.given_options(Open(levl=2)) == {"levl": 2}
