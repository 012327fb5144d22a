"""The command line's one event, outside any run: ``add_commands``, with which a plugin adds
subcommands to ``hookfit`` (the built-in checkpoint plugin adds ``hookfit export``, the dashboard
``hookfit show``). Added to every plugin manager beside the loop's events
(:mod:`hookfit.hookspecs`), so a plugin may implement it whether or not it takes part in runs."""

from __future__ import annotations

import argparse

from hookfit.hookspecs import hookspec

__all__ = ["add_commands"]


@hookspec
def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add subcommands to the ``hookfit`` command line (outside any run: there is no ``loop``).

    ``commands`` is the ``argparse`` sub-parsers object of ``hookfit``: add a parser with
    ``commands.add_parser(name, help=...)``, its arguments, and ``set_defaults(run=function)``
    where ``function(args) -> int`` does the work and returns the exit status (hookfit takes it
    from the parser, ``get_default("run")``, so an argument may be named ``run``, as in
    ``hookfit show RUN``, unless it has a default of its own: then the command says it has no
    function). Called with
    every enabled plugin (installed, given, not disabled) when the command is not one of
    ``hookfit``'s own (``plugins``, ``hooks``, ``new-plugin``, ``demo``, ``runs``); the checkpoint
    plugin adds ``hookfit export``. A name already taken (by ``hookfit`` itself, whose commands
    come first, or by a plugin asked before) is an error, and so is an exception raised here:
    the plugin then adds no command at all, one line on stderr names it and its error or the
    name and who has it, and the rest of the command line works. A distribution that names a
    function doing the same for each of its plugins that add commands, in the entry-point group
    ``hookfit.commands`` (as hookfit does for its own), is not imported to build the command
    line, which then starts without its imports (torch): see :mod:`hookfit.tools.plugin_commands`.
    """
