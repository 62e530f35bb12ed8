"""A small layer-stack language model for the offload tests (layers at ``model.layers``)."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, d=32, num_layers=4, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(num_layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def batch(step, rank, size=4, length=8, vocab=64):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, vocab, (size, length), generator=g)
    return x, x.roll(-1, 1)
