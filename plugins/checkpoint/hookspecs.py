"""Events of the checkpoint plugin: a finished checkpoint, announced.

Declared by :class:`hookfit.plugins.checkpoint.Checkpoint` (its ``hookspecs`` attribute) and
added to every run whether ``checkpoint`` is enabled, disabled or replaced, so a checkpoint
plugin of another package announces its checkpoints to the same listeners (the dashboard, a
plugin that copies checkpoints elsewhere). What a checkpoint plugin implements to save and
resume a run is the core's: ``batch_checkpoint``/``epoch_checkpoint``, ``save_state`` through
``loop.plugin_states()``, ``loop.state_dict()``, ``resume`` and ``fit_end``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookfit import hookspec

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from hookfit.run import Run


@hookspec
def checkpoint_saved(loop: Run, path: str, reason: str, step: int) -> None:
    """A checkpoint of the run is complete on disk: ``path`` (a file, or a sharded
    checkpoint's folder), written for ``reason`` (``"epoch"``, ``"step"``, ``"interrupt"``,
    ``"max_steps"``, ``"completed"``, ``"failure"``), at global step ``step``.

    Fired by the checkpoint plugin on the training thread, once the write has finished: a
    checkpoint written in the background is announced at the plugin's next save, epoch end,
    checked batch or ``fit_end``, whichever comes first, never from the writer thread. A write
    that failed is not announced. For observers (a dashboard marks it on its curve) and for
    plugins that act on finished checkpoints (copy them elsewhere, upload them): they must not
    change or delete ``path``, whose keeping is the checkpoint plugin's. Main process only.
    The return value is ignored.
    """
