"""The ``hookfit`` command (also ``python -m hookfit``): ``hookfit plugins``, ``hookfit hooks``,
``hookfit new-plugin``, ``hookfit demo``, ``hookfit runs``, and the commands that plugins add (the
``add_commands`` hook: ``hookfit export`` is the built-in checkpoint plugin's, for its own files;
where that plugin is disabled or replaced, ``hookfit export`` says so and which plugin holds
the role, unless the replacement adds an ``export`` of its own)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Sequence

from hookfit.tools import plugin_commands

DESCRIPTION = """\
hookfit's command (python -m hookfit is the same): hookfit plugins, hookfit hooks,
hookfit new-plugin, hookfit demo, hookfit runs, and the commands that the installed
plugins add (hookfit export is the built-in checkpoint plugin's, for its own files)."""
"""``hookfit --help``'s text: plain words, as a terminal shows them (no reStructuredText)."""


def _plugins(args: argparse.Namespace) -> int:
    from hookfit import config, discovery, manager

    try:  # the file a run of --script started here would read (config.find: one rule for both)
        configured = config.load(Path(args.config) if args.config else config.find(script=args.script or ""))
        infos = discovery.collect(strict=False, configured=configured)
    except config.ConfigError as error:
        print(f"hookfit: {error}", file=sys.stderr)
        return 2
    pm = manager.PluginManager()
    pm.register_all(infos, strict=False)
    pm.check_unknown_hooks(strict=False)
    rows: list[dict[str, Any]] = []
    for i in infos:
        state, why = _state(i)
        rows.append({
            "name": i.name,
            "distribution": i.distribution,
            "version": i.version,
            "source": i.source,
            "value": i.value,
            "replaces": i.replaces,
            "enabled": i.enabled,
            "state": state,
            "why": why,
            "hooks": i.hooks,
            "summary": _summary(i.plugin),
            "error": i.error,
            "options": {name: {"value": value if _jsonable(value) else repr(value), "from": source}
                        for name, (value, source) in config.options_of(i.plugin, i.options, i.built).items()}
            if i.plugin is not None else {},
        })
    status = 1 if any(r["error"] for r in rows) else 0
    if args.json:
        print(json.dumps(rows, indent=2))
        return status
    if not rows:
        print("no hookfit plugins installed")
        return 0
    # what "(hookfit.toml)" after an option means; a script's plugin given in code takes the file's options but
    # those its code passes (hookfit.config.fill_in), which the listing, not running the script, cannot see
    print(f"options file: {configured.path or 'none'}" + (
        " (the options listed are a run's, but those its script passes to the plugin in code)"
        if configured.path else ""))
    for row in rows:
        print(f"{row['name']}  [{row['state']}]  {row['distribution']} {row['version']}  ({row['value']})")
        if row["summary"]:
            print(f"    {row['summary']}")
        if row["replaces"]:
            print(f"    replaces: {row['replaces']}")
        if row["error"]:
            print(f"    error: {row['error']}")
            continue
        if row["why"]:
            print(f"    {'disabled by' if row['state'] == 'disabled' else 'inert until'}: {row['why']}")
        if row["enabled"]:
            print(f"    hooks: {', '.join(row['hooks']) or '-'}")
            if row["options"]:
                where = f" ({configured.path.name})" if configured.path else ""
                print("    options: " + ", ".join(
                    f"{name}={option['value']!r}" + (where if option["from"] == "file" else "")
                    for name, option in row["options"].items()))
    return status


def _summary(plugin: Any) -> str | None:
    """What ``plugin`` is, for ``hookfit plugins``: the first sentence of its docstring (its
    class's, or a module plugin's own), on one line, without reStructuredText's double
    backquotes; ``None`` for a plugin not loaded (disabled: never imported) or without one."""
    doc = getattr(plugin, "__doc__", None) if plugin is not None else None
    if not isinstance(doc, str) or not doc.strip():
        return None
    first = " ".join(doc.strip().split("\n\n", 1)[0].split()).replace("``", "")
    end = first.find(". ")
    return first[:end + 1] if end >= 0 else first


def _state(info: Any) -> tuple[str, str | None]:
    """A listed plugin's state and why: ``("error", None)``; ``("disabled", by what)``;
    ``("inert", what turns it on)``, the plugin's own answer (:func:`hookfit.discovery.inert`);
    or ``("active", None)``. A plugin whose answer fails is an error of its own."""
    from hookfit import discovery

    if info.error:
        return "error", None
    if not info.enabled:
        return "disabled", info.disabled_by
    try:
        how = discovery.inert(info.plugin, info.chosen)
    except Exception as error:
        info.error = f"inert(chosen) failed: {type(error).__name__}: {error}"
        return "error", None
    return ("inert", how) if how is not None else ("active", None)


def _jsonable(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def hooks_reference(markdown: bool = False) -> str:
    """Every event with its signature and documentation: the core's (:mod:`hookfit.hookspecs`),
    then, plugin by plugin, the events each discovered plugin declares (its ``hookspecs``,
    enabled or not), then the types the events carry: the run (``loop``), its state and the
    payloads of :mod:`hookfit.payloads`. As markdown (``core/hooks.md``) it opens with
    ``core/loop.md``: the loop, one batch traced and the rules every event keeps."""
    import inspect

    from hookfit import discovery, hookspecs, payloads
    from hookfit.tools import hookspecs as command_events
    from hookfit.position import Position
    from hookfit.state import State

    out = []
    if markdown:
        out += ["# hookfit events", "",
                "Generated from `core/loop.md`, `core/hookspecs.py`, the plugins' own `hookspecs` and "
                "`core/payloads.py` by `hookfit hooks --markdown`; do not edit by hand.", "",
                _loop_document(), "", "# The core's events", ""]
    out += _events(hookspecs, markdown)
    if markdown:
        out += ["# The command line's event", "", inspect.getdoc(command_events) or "", ""]
    else:
        out += [f"-- the command line's event ({command_events.__name__})", ""]
    out += _events(command_events, markdown)
    for plugin, specs in discovery.discovered_events():
        where = specs.__name__ if inspect.ismodule(specs) else f"{specs.__module__}.{specs.__qualname__}"
        if markdown:
            out += [f"# Events of the plugin `{plugin}`", "", f"Declared in `{where}`.", "",
                    inspect.getdoc(specs) or "", ""]
        else:
            out += [f"-- events of the plugin {plugin!r} ({where})", ""]
        out += _events(specs, markdown)
    types = [("hookfit.run.Run", None), ("hookfit.State", State), ("hookfit.position.Position", Position)]
    types += [(f"hookfit.payloads.{name}", getattr(payloads, name)) for name in payloads.__all__]
    if markdown:
        out += ["# Types the events carry", "", inspect.getdoc(payloads) or "", ""]
    for qualified, cls in types:
        if cls is None:  # the run: its documentation, without importing torch here
            doc, signature = _run_doc(), "  # made by Loop.fit(); hooks receive it as `loop`"
        else:
            doc = inspect.getdoc(cls) or ""
            signature = str(inspect.signature(cls)).replace("'", "")
        if markdown:
            out += [f"## `{qualified}`", "", "```python", f"{qualified.rsplit('.', 1)[1]}{signature}", "```",
                    "", doc, ""]
        else:
            out += [f"{qualified}{signature}", textwrap.indent(doc, "    "), ""]
    return "\n".join(out)


def _loop_document() -> str:
    """``core/loop.md``, the reference's opening: the loop, one batch traced and the rules every
    event keeps. Read from the installed package (package data), where ``hooks_reference``
    runs."""
    from importlib.resources import files

    return files("hookfit").joinpath("loop.md").read_text(encoding="utf-8").rstrip("\n")


def _events(specs: Any, markdown: bool) -> list[str]:
    """The events declared in ``specs`` (a module or class), each with its signature and
    documentation, in the order they are declared."""
    import inspect

    out = []
    for name, function in vars(specs).items():
        if not hasattr(function, "hookfit_spec"):
            continue
        signature = str(inspect.signature(function)).replace("'", "")
        if not inspect.ismodule(specs):  # a class of specs: its methods take ``self``
            signature = signature.replace("(self, ", "(", 1).replace("(self)", "()", 1)
        opts = function.hookfit_spec
        first = " (first result)" if opts.get("firstresult") else ""
        doc = inspect.getdoc(function) or ""
        if markdown:
            out += [f"## `{name}`{first}", "", "```python", f"{name}{signature}", "```", "", doc, ""]
        else:
            out += [f"{name}{signature}{first}", textwrap.indent(doc, "    "), ""]
    return out


def _run_doc() -> str:
    """:class:`hookfit.run.Run`'s docstring, read from its source so that listing events
    does not import torch."""
    import ast
    import hookfit

    tree = ast.parse((Path(hookfit.__file__).parent / "run.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    return ast.get_docstring(node) or ""


def _hooks(args: argparse.Namespace) -> int:
    print(hooks_reference(markdown=args.markdown), end="\n" if not args.markdown else "")
    return 0


def _new_plugin(args: argparse.Namespace) -> int:
    from hookfit.tools import scaffold

    try:
        root = scaffold.create(args.name, Path(args.dir), replaces=args.replaces)
    except (ValueError, FileExistsError) as exc:
        print(f"hookfit new-plugin: {exc}", file=sys.stderr)
        return 2
    print(f"created {root}\nnext: pip install -e '{root}[test]' && (cd '{root}' && python -m pytest)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from hookfit.tools import demo

    state = demo.main(epochs=args.epochs)
    return 0 if state.status == "completed" else 1


OWN = ("plugins", "hooks", "new-plugin", "demo", "runs")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _runs(args: argparse.Namespace) -> int:
    from hookfit.tools import runs

    root = Path(args.dir)
    if not root.exists():
        print(f"hookfit runs: {root}: no such folder", file=sys.stderr)
        return 2
    infos = [runs.load(folder, metric=args.metric, mode=args.mode) for folder in runs.run_folders(root)]
    if args.json:
        print(json.dumps([info.as_dict() for info in infos], indent=2))
        return 0
    if not infos:
        print(f"no runs in {root}")
        return 0
    rows = [("RUN", "STARTED", "TIME", "STATUS", "EPOCHS", "STEPS", "FINAL", "BEST", "RESUMED FROM")]
    for info in infos:
        best = "-" if info.best is None else f"{info.best[0]} {info.best[1]:.4g} (epoch {info.best[2]})"
        final = "-" if info.final is None else f"{info.final[0]:.4g}" + (
            f" from epoch {info.diverged}" if info.diverged is not None else "") + (  # (a diverged run: NaN, inf)
            " (partial)" if info.partial else "")
        status = _evaluated(info) if info.status == "evaluated" else textwrap.shorten(
            ("evaluation " if info.evaluation else "") + info.status + (f": {info.reason}" if info.reason else ""), 48,
            placeholder=" ...")
        resumed = Path(info.resumed_from).name if info.resumed_from else "-"
        rows.append((info.folder, (info.started or "-").replace("T", " ")[:19], _duration(info.duration),
                     status, str(info.epochs if info.epochs is not None else "-"),
                     str(info.steps if info.steps is not None else "-"), final, best, resumed))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if any(info.partial for info in infos):
        print(runs.PARTIAL)
    undirected = sorted({info.metric for info in infos if info.metric and info.mode is None})
    if undirected:
        print(f"(no best for {', '.join(undirected)}: no direction was configured; give Metrics(best={{...}}) "
              f"in the run, or --mode min|max here)")
    return 0


def _evaluated(info: Any) -> str:
    """The STATUS of a folder of evaluations alone whose last one completed: ``evaluated`` and
    the checkpoint it read, with the run folder that holds it where it is one's
    (``evaluated epoch0005-step000000050.pt of 20260101-120000``)."""
    if not info.evaluated:
        return "evaluated"
    path = Path(info.evaluated)
    owner = path.parent.parent if path.parent.name == "checkpoints" else None
    return f"evaluated {path.name}" + (f" of {owner.name}" if owner is not None and owner.name else "")


class _Parser(argparse.ArgumentParser):
    """``hookfit``'s parser, whose usage on an error names every command, the plugins' included,
    as ``--help`` does, though a command of hookfit's own is parsed without asking the plugins:
    ``complete`` adds theirs first."""

    complete: Callable[[], Any] = staticmethod(lambda: None)

    def error(self, message: str) -> Any:  # (argparse's: prints the usage, exits 2)
        self.complete()
        super().error(message)


def main(argv: Sequence[str] | None = None, plugins: Sequence[Any] = ()) -> int:
    """Entry point of the ``hookfit`` console script; ``plugins`` are added to the installed
    ones for their commands (as ``Loop(plugins=...)``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="hookfit", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)
    p = sub.add_parser("plugins", help="list plugins: name, distribution, what each is, state, hooks, options")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.add_argument("--config", help="the options file to show (default: the one a run would read)")
    p.add_argument("--script", help="list as a run of this script would see them (the hookfit.toml in its "
                                    "folder, else the one in the current folder)")
    p.set_defaults(run=_plugins)
    p = sub.add_parser("hooks", help="print every event with its documentation")
    p.add_argument("--markdown", action="store_true", help="as the Markdown page core/hooks.md")
    p.set_defaults(run=_hooks)
    p = sub.add_parser("new-plugin", help="write a complete plugin package to start from")
    p.add_argument("name", help="the plugin's name (lowercase, digits, underscores)")
    p.add_argument("--dir", default=".", help="where to create hookfit-NAME/ (default: here)")
    p.add_argument("--replaces", action="store_true", help="NAME is a built-in plugin's: the package replaces it on "
                                                           "purpose (its hookfit.replaces entry point)")
    p.set_defaults(run=_new_plugin)
    p = sub.add_parser("demo", help="train a small classifier on scikit-learn's digits")
    p.add_argument("--epochs", type=int, default=8)
    p.set_defaults(run=_demo)
    p = sub.add_parser("runs", help="list runs, newest first: status, epochs, steps, final and best values, resumes "
                                    "(the checkpoint an evaluation read)")
    p.add_argument("dir", nargs="?", default="runs", help="a folder of runs or a run folder (default: runs)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.add_argument("--metric", help="the metric whose best value is shown, as stage/name (default: the "
                                    "metric the run gave a direction, Metrics(best=...), else valid/loss, "
                                    "else train/loss)")
    p.add_argument("--mode", choices=("min", "max"), help="which value of the metric is best, where the run's "
                                                          "log does not say (default: the log's, min for loss)")
    p.set_defaults(run=_runs)
    owners: dict[str, str] = {}
    if not argv or argv[0] not in OWN:  # a plugin's command, or help: ask the plugins
        infos = plugin_commands.add(sub, plugins, owners)
        if argv and argv[0] not in sub.choices and (why := plugin_commands.missing(argv[0], infos)) is not None:
            print(why, file=sys.stderr)
            return 2
    else:  # hookfit's own: the plugins are asked only if the usage is to be shown
        parser.complete = lambda: plugin_commands.add(sub, plugins, owners)
    args = parser.parse_args(argv)
    # the function set_defaults(run=...) gave (a nested subcommand's own included); where an argument named run
    # hid it, the command's parser still holds it
    run: Callable[[argparse.Namespace], int] | None = (
        args.run if callable(getattr(args, "run", None)) else sub.choices[args.command].get_default("run"))
    if not callable(run):
        print(f"hookfit {args.command}: the command of {owners.get(args.command, 'hookfit')} gives hookfit no "
              f"function to run: its parser's set_defaults(run=function) is {run!r}"
              + (" (an argument named 'run' with a default of its own hides it: give that argument another dest)"
                 if run is not None else ""), file=sys.stderr)
        return 2
    try:
        return run(args)
    except BrokenPipeError:  # `hookfit hooks | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
