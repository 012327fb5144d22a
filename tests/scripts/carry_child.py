"""A word-language-model-style run in its own process, for the resume test of ``loop.carry``.

``python carry_child.py RUN_DIR OUT [--kill-at STEP] [--resume]``: a two-layer LSTM with dropout
trains for 3 epochs over a batchified token stream cut into 8 windows (as PyTorch's word
language model example does): the hidden state is carried from one window to the next in
``loop.carry`` (detached: truncated backpropagation through time) and starts afresh each
epoch. A checkpoint is written every step; the final parameters, the final hidden state and the
loss of every step this process ran go to OUT. With ``--kill-at STEP`` the process kills itself
with SIGKILL as soon as the checkpoint of that step is announced whole (``checkpoint_saved``).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("out")
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
VOCAB, BATCH, BPTT = 20, 4, 5
stream = torch.randint(0, VOCAB, (BATCH * (8 * BPTT + 1),), generator=torch.Generator().manual_seed(1))
columns = stream.view(BATCH, -1).t().contiguous()  # (time, batch)
windows = [(columns[i:i + BPTT], columns[i + 1:i + 1 + BPTT]) for i in range(0, 8 * BPTT, BPTT)]


Hidden = tuple[torch.Tensor, torch.Tensor]


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.lstm = torch.nn.LSTM(8, 16, num_layers=2, dropout=0.3)
        self.drop = torch.nn.Dropout(0.3)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor, hidden: Hidden | None) -> tuple[torch.Tensor, Hidden]:
        output, hidden = self.lstm(self.drop(self.embed(tokens)), hidden)
        return self.out(self.drop(output)), hidden


model = Model()
losses: list[float] = []


def step(loop, batch):
    tokens, targets = batch
    logits, hidden = loop.model(tokens, loop.carry.get("hidden"))  # None at an epoch's start
    loop.carry["hidden"] = tuple(h.detach() for h in hidden)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    losses.append(loss.item())
    return {"loss": loss}


class KillAt:
    name = "kill_at"

    @hookfit.hookimpl
    def checkpoint_saved(self, step):
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


class Last:
    """Keeps the training stage's last hidden state for OUT (a stage's carry is its own)."""

    name = "last"
    hidden: tuple[torch.Tensor, ...] = ()

    @hookfit.hookimpl
    def batch_end(self, loop):
        Last.hidden = loop.carry["hidden"]


plugins = [Optim(clip_norm=0.25), Checkpoint(every_n_steps=1, keep_last=2), Last()]
if args.kill_at is not None:
    plugins.append(KillAt())
state = hookfit.Loop(step, windows, model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
                     max_epochs=3, run_dir=args.run_dir, resume="latest" if args.resume else None,
                     plugins=plugins).fit()
torch.save({"params": model.state_dict(), "status": state.status, "step": state.step, "losses": losses,
            "hidden": list(Last.hidden)}, args.out)
