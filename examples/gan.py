"""A small GAN on a 2-D mixture of eight Gaussians, with two optimizers stepped by hand in
alternation. The step returns a dict without a ``loss`` key.

    python examples/gan.py [--epochs N]

At the end it prints how many of the eight modes the generator covers (a sample within 0.5 of a
mode's centre counts for that mode).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

import hookfit

CENTRES = torch.tensor([[2 * math.cos(a), 2 * math.sin(a)] for a in [i * math.pi / 4 for i in range(8)]])


def real_batches(n: int, batch: int = 256, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 8, (batch,), generator=g)
        out.append(CENTRES[idx] + 0.05 * torch.randn(batch, 2, generator=g))
    return out


def mlp(inp: int, out: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(inp, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, out)
    )


def modes_covered(generator: torch.nn.Module, n: int = 2000) -> int:
    with torch.no_grad():
        samples = generator(torch.randn(n, 8))
    distance = torch.cdist(samples, CENTRES)
    near = distance.min(1).values < 0.5
    return int(torch.unique(distance.argmin(1)[near]).numel())


def main(epochs: int = 30, seed: int = 0) -> tuple[hookfit.State, int]:
    torch.manual_seed(seed)
    gen, disc = mlp(8, 2), mlp(2, 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def step(loop: hookfit.Loop, real: torch.Tensor) -> dict[str, Any]:
        g, d = loop.model["gen"], loop.model["disc"]  # through loop.model: what a plugin wraps (DDP) is called
        opts = loop.optimizers
        fake = g(torch.randn(len(real), 8))
        with opts.toggle("disc"):
            d_real, d_fake = d(real), d(fake.detach())
            d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
            opts["disc"].zero_grad()
            loop.backward(d_loss)
            opts["disc"].step()
        with opts.toggle("gen"):
            d_fake = d(fake)
            g_loss = bce(d_fake, torch.ones_like(d_fake))
            opts["gen"].zero_grad()
            loop.backward(g_loss)
            opts["gen"].step()
        return {"d_loss": d_loss, "g_loss": g_loss, "d_real": torch.sigmoid(d_real).mean()}

    state = hookfit.Loop(
        step, real_batches(20, seed=seed), model={"gen": gen, "disc": disc},
        optimizers={
            "gen": torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999)),
            "disc": torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        },
        max_epochs=epochs,
    ).fit()
    covered = modes_covered(gen)
    print(f"gan modes_covered={covered}/8")
    return state, covered


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    state, _ = main(epochs=parser.parse_args().epochs)
    raise SystemExit(0 if state.status == "completed" else 1)
