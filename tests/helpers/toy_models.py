"""A two-block toy model with an attention-like target per block, shared by the
partial-graph tests that need a model without transformers. ``Toy(twice=True)`` calls
block 0's attention twice per forward (a real reuse)."""

import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None):
        return self.o(torch.tanh(self.q(hidden_states)))


class Block(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.self_attn, self.twice = Attn(), twice

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.self_attn(x) if self.twice else x


class Toy(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.layers = nn.ModuleList([Block(twice), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
