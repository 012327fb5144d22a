"""``ckpt_child.py`` (the same training, the same arguments), with its background checkpoint
writes told and paced, for the tests that kill a run inside one.

Each ``torch.save`` on the checkpoint writer's thread prints ``writing`` when it starts, and
every piece it writes to the file waits ``WRITE_PACE`` seconds (default 0.002) first: a write
takes tens of milliseconds, so a kill at a random moment after ``writing`` falls inside the
writer's work (serialisation, fsync, rename) while training goes on. Every other
``torch.save`` (the final parameters) is untouched.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

CHILD = Path(__file__).with_name("ckpt_child.py")
PACE = float(os.environ.get("WRITE_PACE", "0.002"))
WRITER = "hookfit-checkpoint"  # the name of the checkpoint writer's thread
real_save = torch.save


class Paced:
    """A file whose every write waits ``PACE`` seconds first."""

    def __init__(self, file: Any) -> None:
        self.file = file

    def write(self, data: Any) -> int:
        time.sleep(PACE)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    if threading.current_thread().name != WRITER:
        return real_save(obj, f, *args, **kwargs)
    os.write(1, b"writing\n")  # one write of a whole line: never mixed with the training thread's lines
    return real_save(obj, Paced(f), *args, **kwargs)


torch.save = save
sys.argv = [str(CHILD), *sys.argv[1:]]
runpy.run_path(str(CHILD), run_name="__main__")
