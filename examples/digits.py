"""Digits classification: the run ``hookfit demo`` makes, as a script to copy and change.

    python examples/digits.py [--epochs N] [--lr LR] [--run-dir FOLDER]

The data is scikit-learn's 8x8 digits, shipped inside scikit-learn: nothing is downloaded. With
the defaults it trains as ``hookfit demo`` does (the same data, model, seed and optimizer);
``--lr`` and ``--run-dir`` make runs to compare, as the README's ``hookfit compare`` does::

    python examples/digits.py --epochs 12 --lr 3e-3 --run-dir runs/digits/adam-3e-3
    python examples/digits.py --epochs 12 --lr 3e-4 --run-dir runs/digits/adam-3e-4
    hookfit compare runs/digits/adam-3e-3 runs/digits/adam-3e-4
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import hookfit
from hookfit.tools.demo import load_digits


def main(epochs: int = 8, lr: float = 3e-3, run_dir: str | None = None, seed: int = 0) -> hookfit.State:
    """Train the digits classifier with Adam at ``lr`` and return the final state."""
    torch.manual_seed(seed)
    train, valid = load_digits(seed=seed)  # standardised 8x8 images, 80 % to train, batches of 64
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 10))

    def train_step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        x, y = batch
        logits = loop.model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loop.backward(loss)
        loop.optimizers.step()
        loop.optimizers.zero_grad()
        return {"loss": loss, "accuracy": (logits.argmax(1) == y).float().mean()}

    def val_step(loop: hookfit.Run, batch: Any) -> dict[str, Any]:
        x, y = batch
        logits = loop.model(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, y),
                "accuracy": (logits.argmax(1) == y).float().mean()}

    loop = hookfit.Loop(train_step, train, val_step=val_step, val_data=valid, model=model,
                        optimizers=torch.optim.Adam(model.parameters(), lr=lr), max_epochs=epochs, run_dir=run_dir)
    return loop.fit()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--run-dir", help="the run's folder (default: a new runs/digits/<date>-<time>)")
    args = parser.parse_args()
    state = main(epochs=args.epochs, lr=args.lr, run_dir=args.run_dir)
    raise SystemExit(0 if state.status == "completed" else 1)
