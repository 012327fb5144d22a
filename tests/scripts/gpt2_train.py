"""A GPT-2-style training script on hookfit, as published language-model scripts are written:
a small causal transformer, token sequences from a shuffled ``DataLoader`` seeded with a
``generator=`` of its own, AdamW with weight decay, a linear warmup of the learning rate
(``Optim(schedulers=...)``), gradient accumulation over 4 batches, gradient clipping, bf16
autocast, and a checkpoint every 5 steps.

``python gpt2_train.py RUN_DIR OUT [--resume] [--pause-at STEP] [--workers N]``: trains 2
epochs of 24 batches and writes the final parameters to OUT. With ``--pause-at STEP`` it
prints ``paused STEP`` after that training batch's step and waits for a signal, for a test to
kill it there.
"""

from __future__ import annotations

import argparse
import math
import signal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookfit
from hookfit.plugins.checkpoint import Checkpoint
from hookfit.plugins.optim import Optim

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("out")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--pause-at", type=int, default=None)
parser.add_argument("--workers", type=int, default=0)
args = parser.parse_args()

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 64, 16, 32, 4, 2


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, blocks, a final norm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        return self.head(self.ln_f(self.blocks(x)))


torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT()
tokens = torch.randint(0, VOCAB, (96, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=True, drop_last=True,
                  generator=torch.Generator().manual_seed(42), num_workers=args.workers)
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.95))
warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))


def step(loop, batch):
    x, y = batch
    logits = loop.model(x)
    loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
    loop.backward(loss)
    loop.optimizers.step()
    loop.optimizers.zero_grad()
    if loop.state.step + 1 == args.pause_at:  # this batch is the pause-at-th training batch
        print("paused", args.pause_at, flush=True)
        signal.pause()
    return {"loss": loss}


loop = hookfit.Loop(
    step, data, model=model, optimizers=optimizer, max_epochs=2, run_dir=args.run_dir,
    resume="latest" if args.resume else None,
    plugins=[Optim(accumulate=4, clip_norm=1.0, schedulers=warmup, precision="bf16-mixed"),
             Checkpoint(every_n_steps=5, keep_last=2)],
)
state = loop.fit()
torch.save({"params": model.state_dict(), "status": state.status, "step": state.step,
            "resumed_from": state.resumed_from.step if state.resumed_from else None}, args.out)
print("status", state.status, state.step, flush=True)
