"""``hookfit demo``: a small real classification run on scikit-learn's 8x8 digits.

The data ships inside scikit-learn, so nothing is downloaded. A two-layer network reaches
about 95 % validation accuracy in a few seconds on two CPU cores, with every built-in plugin
that applies (optimizer stepping, metrics, console or dashboard, interrupter).

On an interactive terminal the dashboard keeps its final screen until the user leaves it
(``HOOKFIT_TUI_PERSISTENT=1`` unless the environment says otherwise): a run this short would
otherwise flash by. At the end the demo says where its run folder is and how to look at it
again (``hookfit show``). Where there is no dashboard, it says why first: no terminal, urwid
missing (what to install), or no plugin of the run drawing one.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

import hookfit


def load_digits(batch_size: int = 64, seed: int = 0) -> tuple[list[Any], list[Any]]:
    """Train and validation batches of the digits data, standardised, as tensors."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:  # pragma: no cover - the README's set-up installs it
        raise SystemExit("hookfit demo needs scikit-learn: pip install 'hookfit[demo]'") from exc
    x, y = sk_load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-6
    x = (x - mean) / std

    def batches(lo: int, hi: int) -> list[Any]:
        return [(x[i : min(i + batch_size, hi)], y[i : min(i + batch_size, hi)]) for i in range(lo, hi, batch_size)]

    return batches(0, split), batches(split, len(x))


def no_dashboard() -> str | None:
    """Why a run that no plugin took the terminal for shows no dashboard, with what to install
    where urwid is missing; ``None`` where the dashboard itself already said why (a terminal
    without urwid: its warning)."""
    try:
        from hookfit.plugins.tui.terminal import NO_URWID, interactive_terminal
    except ImportError:  # pragma: no cover - the dashboard ships with hookfit
        return "the dashboard plugin (hookfit.plugins.tui) cannot be imported"
    reason = interactive_terminal()
    if reason == NO_URWID:
        return None
    if reason is None:
        return "no plugin of this run draws one (is the tui plugin disabled?)"
    try:
        found = importlib.util.find_spec("urwid") is not None
    except (ImportError, ValueError):
        found = False
    return reason if found else f"{reason}; and {NO_URWID}"


def main(epochs: int = 8, seed: int = 0) -> hookfit.State:
    """Train the digits classifier and return the final state."""
    torch.manual_seed(seed)
    train, valid = load_digits(seed=seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10))

    def train_step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        x, y = batch
        logits = loop.model(x)  # the run's model: under torchrun, wrapped for several processes
        loss = torch.nn.functional.cross_entropy(logits, y)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "accuracy": (logits.argmax(1) == y).float().mean()}

    def val_step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        x, y = batch
        logits = loop.model(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}

    folders: list[Any] = []

    class RunFolder:  # where this run's files are, to say so at the end; and why there is no dashboard
        name = "demo"  # (in the start line's plugins, which named it by its class)

        @hookfit.hookimpl
        def fit_start(self, loop: hookfit.Run) -> None:
            claim = getattr(loop.hooks, "claim_output", None)
            if loop.is_main and (claim is None or claim(loop) is None):
                why = no_dashboard()
                if why is not None:
                    print(f"hookfit demo: no dashboard: {why}", flush=True)

        @hookfit.hookimpl
        def fit_end(self, loop: hookfit.Run) -> None:
            if loop.is_main:
                folders.append(loop.run_dir)

    loop = hookfit.Loop(
        train_step, train, val_step=val_step, val_data=valid, model=model,
        optimizers=torch.optim.Adam(model.parameters(), lr=3e-3), max_epochs=epochs, name="demo",
        plugins=[RunFolder()],
    )
    persistent = "HOOKFIT_TUI_PERSISTENT"  # the dashboard's documented switch (used only on a terminal)
    given = os.environ.get(persistent)
    os.environ.setdefault(persistent, "1")
    try:
        state = loop.fit()
    finally:
        if given is None:
            os.environ.pop(persistent, None)
    for folder in folders:
        shown = os.path.relpath(folder) if not os.path.relpath(folder).startswith("..") else str(folder)
        print(f"hookfit demo: this run's files are in {shown}; look at it again with: hookfit show {shown}")
    return state
