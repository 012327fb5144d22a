"""hookfit.tools.cli: ``hookfit plugins``, ``hookfit hooks`` and the reference page it generates."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

import hookfit
from conftest import make_dist
from conftest import REPO


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hookfit.tools.cli", *args], capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=120,
    )


@pytest.mark.slow
@pytest.mark.bad_input
def test_hookfit_plugins_lists_name_distribution_hooks_and_state(dists: Path, tmp_path: Path) -> None:
    make_dist(tmp_path / "broken", "broken-plugin", {"broken": "does_not_exist_mod"}, {})
    path = os.pathsep.join([str(dists), str(tmp_path / "broken")])
    env = {"PYTHONPATH": path, "HOOKFIT_DISABLE_PLUGINS": "beta"}  # built-ins listed too
    env.pop("HOOKFIT_PLUGINS", None)
    result = cli("plugins", "--json", env={**env})
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["alpha"]["distribution"] == "fake-plugins" and rows["alpha"]["version"] == "1.2.3"
    assert rows["alpha"]["enabled"] is True and rows["alpha"]["hooks"] == ["batch_end"]
    assert rows["beta"]["enabled"] is False
    assert "ModuleNotFoundError" in rows["broken"]["error"]
    assert rows["interrupter"]["distribution"] == "hookfit"
    assert result.returncode == 1  # a broken plugin is an error, listed not hidden

    text = cli("plugins", env={**env, "HOOKFIT_DISABLE_PLUGINS": "broken"})
    assert text.returncode == 0, text.stderr
    assert "alpha  [active]  fake-plugins 1.2.3" in text.stdout
    assert "hooks: batch_end" in text.stdout
    assert "broken  [disabled]" in text.stdout


GAMMA = '''
import hookfit

class Gamma:
    """Counts the batches of
    every epoch (a wrapped first sentence). Then more.

    And a second paragraph."""

    @hookfit.hookimpl
    def batch_end(self, batch_idx):
        pass
'''


@pytest.mark.slow
def test_hookfit_plugins_says_what_each_plugin_is_from_its_docstring(dists: Path, tmp_path: Path) -> None:
    """The first sentence of each loaded plugin's docstring, on one line under its name: a
    built-in's, a third-party class's; a plugin without one (a class, a module) and a disabled
    one (never imported) show no such line."""
    make_dist(tmp_path / "gamma", "gamma-plugin", {"gamma": "gamma_mod:Gamma"}, {"gamma_mod": GAMMA})
    env = {"PYTHONPATH": os.pathsep.join([str(dists), str(tmp_path / "gamma")]), "HOOKFIT_DISABLE_PLUGINS": "csv"}
    rows = {row["name"]: row for row in json.loads(cli("plugins", "--json", env=env).stdout)}
    assert rows["gamma"]["summary"] == "Counts the batches of every epoch (a wrapped first sentence)."
    assert rows["interrupter"]["summary"] == "Turns SIGINT and SIGTERM into stop requests; a second SIGINT aborts."
    assert rows["alpha"]["summary"] is None and rows["beta"]["summary"] is None  # no docstring
    assert rows["csv"]["summary"] is None  # disabled: not imported
    done = cli("plugins", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("gamma  [active]  gamma-plugin 1.2.3")))
    assert lines[at + 1] == "    Counts the batches of every epoch (a wrapped first sentence)."
    at = lines.index(next(line for line in lines if line.startswith("alpha  [active]")))
    assert lines[at + 1] == "    hooks: batch_end"
    at = lines.index(next(line for line in lines if line.startswith("checkpoint  [active]  hookfit")))
    assert lines[at + 1] == "    Atomic checkpoints of model, optimizers, plugins, position and RNG; exact resume."


@pytest.mark.slow
def test_hookfit_hooks_prints_every_event() -> None:
    """The core's events first, then each plugin's under its name."""
    from conftest import spec_names
    from hookfit.testing import plugin_events

    out = cli("hooks").stdout
    for name in [*spec_names(), *plugin_events()]:
        assert f"\n{name}(" in "\n" + out
    core, plugins = out.split("\n-- events of the plugin ", 1)
    assert "\nmetrics_update(" in "\n" + plugins and "\nmetrics_update(" not in "\n" + core
    assert "\nbatch_end(" in "\n" + core


def test_the_reference_page_opens_with_the_loop_and_has_a_section_per_plugin() -> None:
    page = (REPO / "core" / "hooks.md").read_text()
    opening = page.split("\n# ", 2)[0]
    assert "for epoch in" in opening and "The ten events a first plugin needs" in opening
    for plugin, event in [("optim", "before_optimizer_step"), ("metrics", "metrics_update"),
                          ("distributed", "all_reduce"), ("tui", "claim_output")]:
        section = page.split(f"\n# Events of the plugin `{plugin}`\n", 1)[1].split("\n# ", 1)[0]
        assert f"\n## `{event}`" in section
    core = page.split("\n# The core's events\n", 1)[1].split("\n# ", 1)[0]
    assert "\n## `batch_end`" in core and "\n## `metrics_update`" not in core


def test_the_hooks_reference_page_is_up_to_date() -> None:
    from pathlib import Path

    from hookfit.tools.cli import hooks_reference

    page = REPO / "core" / "hooks.md"
    assert page.read_text() == hooks_reference(markdown=True), (
        "core/hooks.md is stale: run `hookfit hooks --markdown > core/hooks.md`")


def test_python_m_hookfit_is_the_command_and_its_help_names_every_subcommand() -> None:
    done = subprocess.run([sys.executable, "-m", "hookfit", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    description = done.stdout.split("positional arguments")[0].split("\n\n", 1)[1]
    for command in ("plugins", "hooks", "new-plugin", "demo"):
        assert f"hookfit {command}" in description, description
    assert "``" not in done.stdout  # plain words on a terminal, not reStructuredText


@pytest.mark.slow
def test_hookfit_plugins_says_active_inert_and_how_or_disabled_and_by_what(tmp_path: Path) -> None:
    """Each plugin's state with the reason: inert plugins say what turns them on (their own
    answer, ``inert(chosen)``), disabled ones what disabled them; a table turns a plugin on."""
    (tmp_path / "hookfit.toml").write_text("[plugins.tensorboard]\n\n[plugins.console]\nenabled = false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKFIT_")}
    env.update(HOOKFIT_DISABLE_PLUGINS="tui", HOOKFIT_CONFIG=str(tmp_path / "hookfit.toml"))
    done = subprocess.run([sys.executable, "-m", "hookfit.tools.cli", "plugins", "--json"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=tmp_path)
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    states = {name: (row["state"], row["why"]) for name, row in rows.items()}
    assert states["optim"] == ("active", None) and states["metrics"] == ("active", None)
    assert states["tensorboard"] == ("active", None)  # the empty table turned it on
    for name, how in [("csv", "[plugins.csv] table in hookfit.toml (even empty)"), ("profile", "[plugins.profile]"),
                      ("mlflow", "[plugins.mlflow]"), ("wandb", "Loop(plugins=[WandB()])"),
                      ("ema", "given a decay"), ("early_stopping", "given a monitor")]:
        assert states[name][0] == "inert" and how in states[name][1], (name, states[name])
    assert states["tui"] == ("disabled", "HOOKFIT_DISABLE_PLUGINS=tui")
    assert states["console"] == ("disabled", f"{tmp_path / 'hookfit.toml'} [plugins.console] enabled = false")
    assert rows["console"]["enabled"] is False and rows["csv"]["enabled"] is True

    env["HOOKFIT_PLUGINS"] = "optim,csv"
    text = subprocess.run([sys.executable, "-m", "hookfit.tools.cli", "plugins"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path).stdout
    assert "optim  [active]  hookfit" in text
    assert ("csv  [inert]  hookfit" in text and "    inert until: given to Loop(plugins=[CSVLogger()]), or named "
            "by a [plugins.csv] table in hookfit.toml (even empty)" in text)
    assert "metrics  [disabled]" in text and "    disabled by: HOOKFIT_PLUGINS=optim,csv (not listed there)" in text


@pytest.mark.slow
def test_hookfit_plugins_names_the_package_that_holds_a_role_and_what_it_replaced(tmp_path: Path) -> None:
    site = make_dist(tmp_path / "site", "my-checkpoint", {"checkpoint": "my_ckpt_mod:Saver"},
                     {"my_ckpt_mod": "import hookfit\n\nclass Saver:\n    @hookfit.hookimpl\n"
                                     "    def after_epoch(self, loop, epoch):\n        pass\n"})
    listed = site / "my_checkpoint-1.2.3.dist-info" / "entry_points.txt"
    listed.write_text(listed.read_text() + "\n[hookfit.replaces]\ncheckpoint = hookfit\n")
    env = {"PYTHONPATH": str(site), "HOOKFIT_PLUGINS": "checkpoint"}
    text = cli("plugins", env=env)
    assert text.returncode == 0, text.stderr
    assert "two distributions" not in text.stderr, text.stderr
    lines = text.stdout.splitlines()
    at = lines.index("checkpoint  [active]  my-checkpoint 1.2.3  (my_ckpt_mod:Saver)")
    assert lines[at + 1].startswith("    replaces: hookfit ") and lines[at + 1].endswith(
        "(hookfit.plugins.checkpoint:Checkpoint)"), lines[at + 1]
    rows = {row["name"]: row for row in json.loads(cli("plugins", "--json", env=env).stdout)}
    assert rows["checkpoint"]["distribution"] == "my-checkpoint"
    assert rows["checkpoint"]["replaces"].endswith("(hookfit.plugins.checkpoint:Checkpoint)")


@pytest.mark.bad_input
def test_hookfit_export_without_the_builtin_checkpoint_says_which_plugin_holds_the_role(tmp_path: Path) -> None:
    """``hookfit export`` reads the built-in checkpoint's files: replaced by a plugin that adds no
    ``export``, or disabled, it says so instead of argparse's bare "invalid choice"."""
    site = make_dist(tmp_path / "site", "my-checkpoint", {"checkpoint": "my_ckpt_mod:Saver"},
                     {"my_ckpt_mod": "class Saver:\n    pass\n"})
    listed = site / "my_checkpoint-1.2.3.dist-info" / "entry_points.txt"
    listed.write_text(listed.read_text() + "\n[hookfit.replaces]\ncheckpoint = hookfit\n")
    replaced = cli("export", "runs/x", "model.pt", env={"PYTHONPATH": str(site), "HOOKFIT_PLUGINS": "checkpoint"})
    assert replaced.returncode == 2
    assert "invalid choice" not in replaced.stderr
    assert ("hookfit export: this is the command of hookfit's built-in plugin 'checkpoint', and plugin "
            "'checkpoint' (my-checkpoint 1.2.3, entry point my_ckpt_mod:Saver) holds that role here and adds "
            "no 'export' command") in replaced.stderr, replaced.stderr
    disabled = cli("export", "runs/x", "model.pt", env={"HOOKFIT_PLUGINS": "", "HOOKFIT_DISABLE_PLUGINS": "checkpoint"})
    assert disabled.returncode == 2
    assert "'checkpoint', which is disabled (HOOKFIT_DISABLE_PLUGINS=checkpoint)" in disabled.stderr, disabled.stderr
    assert "invalid choice: 'nothing'" in cli("nothing", env={"HOOKFIT_PLUGINS": ""}).stderr  # no built-in's: argparse's


@pytest.mark.bad_input
@pytest.mark.parametrize("text, said", [
    ("[plugins.uninstalled]\nbelow = 0.1\n", "[plugins.uninstalled]: no plugin named 'uninstalled' is installed"),
    ("[plugins.tui\n", "not valid TOML"),
])
def test_a_bad_configuration_file_is_said_in_one_line_and_help_and_the_builtin_commands_stay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str,
        said: str) -> None:
    """A file naming a plugin since uninstalled, or a file that is not TOML: one line on stderr, and
    ``hookfit --help``, ``show``, ``compare`` and ``export`` are there as without the file (the tui
    plugin is not said to be disabled)."""
    from hookfit.tools import cli as command

    (tmp_path / "hookfit.toml").write_text(text)
    monkeypatch.setenv("HOOKFIT_CONFIG", str(tmp_path / "hookfit.toml"))
    monkeypatch.setenv("HOOKFIT_PLUGINS", "tui,checkpoint")
    with pytest.raises(SystemExit) as helped:
        command.main(["--help"])
    out, err = capsys.readouterr()
    assert helped.value.code == 0 and all(f"{c}," in out or f"{c}}}" in out for c in ("show", "compare", "export"))
    assert err.count("\n") == 1 and said in err and "(the commands are added as if there were no such file)" in err
    assert command.main(["show", "--text", str(tmp_path / "gone")]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [f"hookfit show: {tmp_path / 'gone'}: no such run folder"]


class Commands:
    """A plugin adding the commands ``names``; its add_commands raises ``fails`` once they are added."""

    def __init__(self, name: str, *names: str, fails: Exception | None = None) -> None:
        self.name, self.names, self.fails = name, names, fails

    @hookfit.hookimpl
    def add_commands(self, commands):
        for name in self.names:
            commands.add_parser(name, help=f"{self.name}'s {name}").set_defaults(run=lambda args: 0)
        if self.fails is not None:
            raise self.fails


@pytest.mark.bad_input
def test_a_plugin_whose_add_commands_fails_or_takes_a_name_adds_no_command_and_the_others_stay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One package's add_commands that raises, or takes ``show``: one line names the plugin and its
    error or the name and who has it, none of that plugin's commands is added, and the rest works."""
    from hookfit.tools import cli as command

    monkeypatch.setenv("HOOKFIT_PLUGINS", "tui,checkpoint")
    plugins = [Commands("fine", "fine-cmd"), Commands("buggy", "buggy-cmd", fails=RuntimeError("no parser today")),
               Commands("taker", "taker-cmd", "show"), Commands("late", "fine-cmd")]
    with pytest.raises(SystemExit) as helped:
        command.main(["--help"], plugins=plugins)
    out, err = capsys.readouterr()
    assert helped.value.code == 0
    assert "{plugins,hooks,new-plugin,demo,runs,show,compare,export,fine-cmd}" in out.replace("\n", "").replace(" ", "")
    here = f"{__name__}.Commands, given to Loop"
    assert sorted(err.splitlines()) == sorted([
        f"hookfit: plugin 'buggy' ({here}) failed in add_commands: RuntimeError: no parser today; its commands are "
        "left out",
        f"hookfit: plugin 'taker' ({here}) adds the command 'show', which plugin 'tui' (hookfit 0.1.0, entry point "
        "hookfit.plugins.tui:TuiRenderer) adds; its commands are left out",
        f"hookfit: plugin 'fine' ({here}) adds the command 'fine-cmd', which plugin 'late' ({here}) adds; its "
        "commands are left out"])  # (the last plugin given is asked first, as pluggy calls them)
    assert command.main(["show", "--text", str(tmp_path / "gone")], plugins=plugins) == 2  # hookfit's show
    assert capsys.readouterr().err.endswith(f"hookfit show: {tmp_path / 'gone'}: no such run folder\n")


class RunArgument:
    """A plugin command ``trace RUN`` whose positional argument is named ``run``, as hookfit's own
    ``show RUN`` reads; ``default`` gives that argument a default of its own, ``function=None`` no
    ``set_defaults(run=...)`` at all."""

    name = "tracer"

    def __init__(self, default: str | None = None, function: bool = True) -> None:
        self.default, self.function, self.seen = default, function, []

    @hookfit.hookimpl
    def add_commands(self, commands):
        parser = commands.add_parser("trace", help="summarise a run")
        if self.function:
            parser.set_defaults(run=lambda args: self.seen.append(args.run) or 0)
        if self.default is None:
            parser.add_argument("run")
        else:
            parser.add_argument("run", nargs="?", default=self.default)


@pytest.mark.bad_input
def test_a_plugin_command_may_name_an_argument_run_and_one_that_hides_its_function_is_named(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """set_defaults(run=function) and an argument named run share ``args.run``: hookfit takes the
    function from the command's parser, so the argument is the plugin's; where none can be found,
    one line names the command and the plugin."""
    from hookfit.tools import cli as command

    named = RunArgument()
    assert command.main(["trace", "runs/t"], plugins=[named]) == 0 and named.seen == ["runs/t"]
    here = f"plugin 'tracer' ({__name__}.RunArgument, given to Loop)"
    capsys.readouterr()
    assert command.main(["trace"], plugins=[RunArgument(default="runs/last")]) == 2
    assert capsys.readouterr().err == (
        f"hookfit trace: the command of {here} gives hookfit no function to run: its parser's set_defaults(run="
        "function) is 'runs/last' (an argument named 'run' with a default of its own hides it: give that argument "
        "another dest)\n")
    assert command.main(["trace", "x"], plugins=[RunArgument(function=False)]) == 2
    assert capsys.readouterr().err == (
        f"hookfit trace: the command of {here} gives hookfit no function to run: its parser's set_defaults(run="
        "function) is None\n")

    class Bare:
        name = "bare"

        @hookfit.hookimpl
        def add_commands(self, commands):
            commands.add_parser("bare", help="no set_defaults at all")

    assert command.main(["bare"], plugins=[Bare()]) == 2
    assert capsys.readouterr().err.endswith("set_defaults(run=function) is None\n")


class Nested:
    """A plugin command ``sync up|down`` whose subcommands each give their own ``set_defaults(run=...)``,
    argparse's usual pattern for nested commands."""

    name = "syncer"

    def __init__(self) -> None:
        self.ran: list[str] = []

    @hookfit.hookimpl
    def add_commands(self, commands):
        parser = commands.add_parser("sync", help="sync runs")
        nested = parser.add_subparsers(dest="direction", required=True)
        for direction in ("up", "down"):
            nested.add_parser(direction).set_defaults(run=lambda args, d=direction: self.ran.append(d) or 0)


def test_a_plugin_command_with_subcommands_of_its_own_runs_the_one_chosen() -> None:
    """A nested subcommand's set_defaults(run=...) is the function run, not the top command's (none)."""
    from hookfit.tools import cli as command

    nested = Nested()
    assert command.main(["sync", "down"], plugins=[nested]) == 0
    assert command.main(["sync", "up"], plugins=[nested]) == 0
    assert nested.ran == ["down", "up"]


@pytest.mark.bad_input
def test_the_usage_on_an_error_of_hookfit_s_own_command_names_every_command_as_help_does(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The usage ``hookfit runs a b`` prints names every command ``hookfit --help`` lists: show,
    compare, export and the plugins' commands with hookfit's own."""
    from hookfit.tools import cli as command

    monkeypatch.setenv("HOOKFIT_PLUGINS", "tui,checkpoint")
    with pytest.raises(SystemExit) as helped:
        command.main(["--help"], plugins=[Commands("mine", "mine-cmd")])
    listed = capsys.readouterr().out.split("\n\n")[0].replace("\n", "").replace(" ", "")
    with pytest.raises(SystemExit) as failed:
        command.main(["runs", "a", "b"], plugins=[Commands("mine", "mine-cmd")])
    usage, said = capsys.readouterr().err.rsplit("\n", 2)[:2]
    assert (helped.value.code, failed.value.code) == (0, 2) and said == "hookfit: error: unrecognized arguments: b"
    assert usage.replace("\n", "").replace(" ", "") == listed
    assert "{plugins,hooks,new-plugin,demo,runs,show,compare,export,mine-cmd}" in listed
