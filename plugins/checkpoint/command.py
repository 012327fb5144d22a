"""``hookfit export``'s command line (the checkpoint plugin's ``add_commands``), apart from
:mod:`hookfit.plugins.checkpoint.export`, which it imports when the command runs: adding the
command to ``hookfit`` imports neither torch nor the plugin."""

from __future__ import annotations

import argparse
import sys


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hookfit export`` (the checkpoint plugin's ``add_commands``)."""
    p = commands.add_parser("export", help="write a run's model as one plain state dict (sharded checkpoints too)")
    p.add_argument("source", help="a run folder, a folder of checkpoints, or a checkpoint")
    p.add_argument("out", help="the file to write, such as model.pt")
    p.add_argument("--weights", metavar="PLUGIN", default=None,
                   help="write the weights that plugin keeps in the checkpoint instead of the model's "
                        "(--weights ema: the ema plugin's average)")
    p.add_argument("--best", action="store_true", help="the run's best checkpoint by the metric its checkpoints "
                                                       "were scored on (Checkpoint(monitor=...)), not its newest")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from hookfit.plugins.checkpoint.export import export
    from hookfit.plugins.checkpoint.storage import CheckpointError

    try:
        done = export(args.source, args.out, weights=args.weights, best_of_run=args.best)
    except (OSError, CheckpointError) as error:
        print(f"hookfit export: {error}" if not str(error).startswith("hookfit export") else str(error),
              file=sys.stderr)
        return 2
    which = f" (the best by {done.best[0]}: {done.best[1]:g})" if done.best is not None else ""
    if done.weights is None:
        print(f"wrote {args.out}: the model of {done.checkpoint}{which}")
        for name in done.offered:
            print(f"hookfit export: {done.checkpoint} also holds the weights of plugin {name!r}: "
                  f"--weights {name} writes those")
    else:
        print(f"wrote {args.out}: the weights of plugin {done.weights!r} in {done.checkpoint}{which}")
    return 0
