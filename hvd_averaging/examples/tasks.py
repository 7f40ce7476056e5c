"""The demo's two tasks: a character-level transformer language model on the Python standard
library's own source (the main job), and the digits MLP (fast, for tests). Each gives a model, an
endless stream of batches from this rank's shard, a loss and a held-out metric. No download:
both datasets ship with Python or scikit-learn.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["CharLMTask", "DigitsTask", "TASKS", "stdlib_text"]


def stdlib_text() -> str:
    """The top-level ``.py`` files of this Python's standard library, by name, concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join(path.read_text(encoding="utf-8", errors="replace")
                     for path in sorted(root.glob("*.py")))


class CharTransformer(torch.nn.Module):
    """A small causal transformer over bytes (pre-norm, learned positions)."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(hidden))


class CharLMTask:
    """Next-character prediction on the standard library's source; metric: held-out loss.

    The text is encoded as bytes clipped to 7 bits (vocabulary 128); the last 5% is held out.
    The training part is split into one contiguous shard per rank; each rank samples windows of
    ``context + 1`` characters from its shard with its own seeded generator.
    """

    name = "charlm"
    metric = "held-out loss"
    lower_is_better = True
    default_lr = 6e-3  # the best of 3e-3, 6e-3, 1.2e-2 for every method: docs/demo.md, sweep

    def __init__(self, width: int = 96, layers: int = 3, heads: int = 4, context: int = 64,
                 batch_size: int = 16, eval_windows: int = 64):
        data = torch.frombuffer(bytearray(stdlib_text().encode("utf-8")), dtype=torch.uint8)
        tokens = (data & 127).long()
        split = int(len(tokens) * 0.95)
        self.train_tokens, self.held_out = tokens[:split], tokens[split:]
        self.width, self.layers, self.heads, self.context = width, layers, heads, context
        self.batch_size = batch_size
        # fixed held-out windows, evenly spaced
        starts = torch.linspace(0, len(self.held_out) - context - 2, eval_windows).long()
        self.eval_x = torch.stack([self.held_out[s:s + context] for s in starts])
        self.eval_y = torch.stack([self.held_out[s + 1:s + context + 1] for s in starts])

    def describe(self) -> str:
        return (f"character-level transformer ({self.layers} layers, width {self.width}, context "
                f"{self.context}) on {len(self.train_tokens) / 1e6:.1f} M characters of the "
                f"standard library's source, held-out {len(self.held_out) / 1e3:.0f} k")

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return CharTransformer(128, self.width, self.layers, self.heads, self.context)

    def batches(self, rank: int, size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        shard = len(self.train_tokens) // size
        tokens = self.train_tokens[rank * shard:(rank + 1) * shard]
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        offsets = torch.arange(self.context + 1)
        while True:
            starts = torch.randint(0, len(tokens) - self.context - 1, (self.batch_size,),
                                   generator=generator)
            windows = tokens[starts[:, None] + offsets]
            yield windows[:, :-1], windows[:, 1:]

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).reshape(-1, 128), y.reshape(-1))

    def evaluate(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            return self.loss(model, self.eval_x, self.eval_y).item()

    def inner_optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


class DigitsTask:
    """scikit-learn's bundled 8x8 digits (1797 images, 25% held out, stratified), a 64-128-64-10
    MLP; metric: held-out accuracy."""

    name = "digits"
    metric = "test accuracy"
    lower_is_better = False
    default_lr = 0.05

    def __init__(self, batch_size: int = 16, seed: int = 0):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(
            x / 16.0, y, test_size=0.25, random_state=seed, stratify=y)
        self.x_train = torch.tensor(x_train, dtype=torch.float32)
        self.y_train = torch.tensor(y_train, dtype=torch.int64)
        self.x_test = torch.tensor(x_test, dtype=torch.float32)
        self.y_test = torch.tensor(y_test, dtype=torch.int64)
        self.batch_size = batch_size

    def describe(self) -> str:
        return f"digits MLP, {len(self.x_train)} training images"

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 10))

    def batches(self, rank: int, size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.x_train[rank::size], self.y_train[rank::size]
        generator = torch.Generator().manual_seed(seed + rank)
        while True:
            order = torch.randperm(len(x), generator=generator)
            for i in range(len(x) // self.batch_size):
                idx = order[i * self.batch_size:(i + 1) * self.batch_size]
                yield x[idx], y[idx]

    def loss(self, model, x, y) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def evaluate(self, model) -> float:
        with torch.no_grad():
            return (model(self.x_test).argmax(dim=1) == self.y_test).float().mean().item()

    def inner_optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.9)


TASKS = {"charlm": CharLMTask, "digits": DigitsTask}
