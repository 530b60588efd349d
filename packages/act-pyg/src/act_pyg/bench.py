"""GNN benchmark: accuracy, activation memory and epoch time, full precision vs compressed.

    python -m act_pyg.bench --model gcn|sage|gat [--level L3] [--get-mem] [--epochs 100]
        [--seeds 3] [--random-projection 0.125] [--data PATH] [--device cpu]

Trains a 2-layer model on a graph that builds offline (a planted-partition graph with
class-dependent features, made here from a seed), or on a ``torch_geometric.data.Data``
saved with ``torch.save`` (``--data``; it needs ``x``, ``y``, ``edge_index`` and, if it has
them, ``train_mask``/``test_mask``). Each seed trains the same initialisation twice, in full
precision and converted, and reports the final test accuracy of both.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from actcore import memory
from actcore.config import LEVELS, level_spec

from .convert import convert

MODELS = ("gcn", "sage", "gat")
# A quick configuration (the accuracy test): about 10 s of CPU for all three models.
SMALL_GRAPH = {"num_nodes": 800, "num_features": 32, "num_classes": 4}
SMALL_RUN = {"epochs": 50, "hidden": 32, "dropout": 0.2}
PLANTED = "planted-partition graph (stochastic block model, class-dependent Gaussian features)"


def planted_partition(
    num_nodes: int = 3000,
    num_classes: int = 8,
    num_features: int = 128,
    avg_degree: float = 10.0,
    homophily: float = 0.6,
    signal: float = 0.4,
    train_fraction: float = 0.3,
    seed: int = 0,
) -> Data:
    """A planted-partition graph: ``homophily`` of each node's edges stay in its class.

    Features are a class centroid (unit Gaussian) times ``signal`` plus unit noise, so a node
    alone is hard to classify and neighbourhoods help. Edges are undirected (both
    directions, no self loops, duplicates possible). Masks split train / test.
    """
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    centroids = torch.randn(num_classes, num_features, generator=gen)
    x = signal * centroids[y] + torch.randn(num_nodes, num_features, generator=gen)
    half = int(num_nodes * avg_degree / 2)
    src = torch.randint(0, num_nodes, (half,), generator=gen)
    same = torch.rand(half, generator=gen) < homophily
    # a random node of the same class for homophilous edges, any node otherwise
    order = torch.argsort(y)
    counts = torch.bincount(y, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    pick = (torch.rand(half, generator=gen) * counts[y[src]]).long()
    dst_same = order[starts[y[src]] + pick]
    dst_any = torch.randint(0, num_nodes, (half,), generator=gen)
    dst = torch.where(same, dst_same, dst_any)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])
    perm = torch.randperm(num_nodes, generator=gen)
    train_mask = torch.zeros(num_nodes, dtype=torch.bool)
    train_mask[perm[: int(train_fraction * num_nodes)]] = True
    data = Data(x=x, y=y, edge_index=edge_index, train_mask=train_mask, test_mask=~train_mask)
    data.source = PLANTED
    return data


def random_graph(num_nodes: int, num_edges: int, num_features: int, seed: int = 0) -> Data:
    """A uniform random directed graph (for memory measurements): ``x``, ``edge_index``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_nodes, num_features, generator=gen)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=gen)
    return Data(x=x, edge_index=edge_index)


class GNN(nn.Module):
    """dropout -> conv -> ReLU -> dropout -> conv, as modules (so all of it is converted)."""

    def __init__(
        self,
        kind: str,
        in_channels: int,
        hidden: int,
        out_channels: int,
        heads: int = 4,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        if kind not in MODELS:
            raise ValueError(f"unknown model {kind!r}; valid models: {', '.join(MODELS)}")
        self.kind = kind
        if kind == "gcn":
            self.conv1 = GCNConv(in_channels, hidden)
            self.conv2 = GCNConv(hidden, out_channels)
        elif kind == "sage":
            self.conv1 = SAGEConv(in_channels, hidden)
            self.conv2 = SAGEConv(hidden, out_channels)
        else:
            self.conv1 = GATConv(in_channels, hidden // heads, heads=heads, dropout=dropout)
            self.conv2 = GATConv(hidden, out_channels, heads=1, dropout=dropout)
        self.drop_in = nn.Dropout(dropout)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = self.drop_in(x)
        x = self.drop(self.act(self.conv1(x, edge_index)))
        return self.conv2(x, edge_index)


@dataclass
class RunResult:
    """One training run."""

    seed: int
    accuracy: float
    epoch_seconds: float


@dataclass
class BenchResult:
    """What :func:`run` measured, full precision vs compressed."""

    model: str
    level: str
    random_projection: float | None
    data: str
    device: str
    epochs: int
    fp: list[RunResult] = field(default_factory=list)
    act: list[RunResult] = field(default_factory=list)
    fp_retained_bytes: int | None = None
    act_retained_bytes: int | None = None

    @property
    def fp_accuracy(self) -> float:
        return statistics.fmean(r.accuracy for r in self.fp)

    @property
    def act_accuracy(self) -> float:
        return statistics.fmean(r.accuracy for r in self.act)


def _train(
    model: nn.Module, data: Data, epochs: int, lr: float, weight_decay: float
) -> tuple[float, float]:
    """Train full-batch with Adam; (test accuracy, mean seconds per epoch)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if data.x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(epochs):
        model.train()
        opt.zero_grad(set_to_none=True)
        out = model(data.x, data.edge_index)
        loss = loss_fn(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        opt.step()
    sync()
    elapsed = (time.perf_counter() - start) / max(epochs, 1)
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(-1)
    mask = data.test_mask
    acc = (pred[mask] == data.y[mask]).float().mean().item()
    return acc, elapsed


def retained_bytes(model: nn.Module, data: Data) -> int:
    """Bytes one training forward leaves held for backward (actcore.memory)."""
    model.train()
    with memory.track(model) as report:
        out = model(data.x, data.edge_index)
    del out
    return report.retained_bytes


def build_model(
    kind: str, data: Data, hidden: int = 64, heads: int = 4, dropout: float = 0.5
) -> GNN:
    classes = int(data.y.max()) + 1 if getattr(data, "y", None) is not None else 8
    return GNN(kind, data.num_features, hidden, classes, heads=heads, dropout=dropout)


def run(
    kind: str,
    data: Data,
    *,
    level: str = "L3",
    epochs: int = 100,
    seeds: Sequence[int] = (0, 1, 2),
    random_projection: float | None = None,
    get_mem: bool = False,
    hidden: int = 64,
    dropout: float = 0.5,
    lr: float = 0.01,
    weight_decay: float = 5e-4,
    device: str = "cpu",
) -> BenchResult:
    """Train ``kind`` on ``data`` per seed, full precision and converted (same init)."""
    level = level_spec(level).name
    data = data.to(device)
    result = BenchResult(
        kind,
        level,
        random_projection,
        getattr(data, "source", "user data"),
        device,
        epochs,
    )
    for seed in seeds:
        torch.manual_seed(seed)
        fp = build_model(kind, data, hidden, dropout=dropout).to(device)
        act = convert(copy.deepcopy(fp), level, random_projection=random_projection)
        for model, runs in ((fp, result.fp), (act, result.act)):
            torch.manual_seed(seed)  # the same dropout stream for both
            acc, sec = _train(model, data, epochs, lr, weight_decay)
            runs.append(RunResult(seed, acc, sec))
    if get_mem:
        torch.manual_seed(0)
        fp = build_model(kind, data, hidden, dropout=dropout).to(device)
        act = convert(copy.deepcopy(fp), level, random_projection=random_projection)
        result.fp_retained_bytes = retained_bytes(fp, data)
        result.act_retained_bytes = retained_bytes(act, data)
    return result


def format_result(r: BenchResult) -> str:
    rp = "off" if r.random_projection is None else f"{r.random_projection}"
    fp_t = statistics.fmean(x.epoch_seconds for x in r.fp) * 1e3
    act_t = statistics.fmean(x.epoch_seconds for x in r.act) * 1e3
    lines = [
        f"model {r.model}, level {r.level}, random projection {rp}, device {r.device}",
        f"data: {r.data}",
        f"{len(r.fp)} seed(s) x {r.epochs} epochs; final test accuracy, mean epoch time",
        f"{'':<14}{'accuracy':>10}{'epoch ms':>10}{'held MiB':>10}",
    ]
    for label, runs, mem, ms in (
        ("fp32", r.fp, r.fp_retained_bytes, fp_t),
        (f"act {r.level}", r.act, r.act_retained_bytes, act_t),
    ):
        acc = statistics.fmean(x.accuracy for x in runs) * 100
        held = "-" if mem is None else f"{mem / 2**20:.2f}"
        lines.append(f"{label:<14}{acc:>9.2f}%{ms:>10.1f}{held:>10}")
    if r.fp_retained_bytes and r.act_retained_bytes:
        lines.append(
            f"activation memory held for backward: {r.fp_retained_bytes / r.act_retained_bytes:.1f}x"
            " smaller"
        )
    lines.append(
        f"accuracy difference (act - fp): {(r.act_accuracy - r.fp_accuracy) * 100:+.2f} points"
    )
    return "\n".join(lines)


def load_data(path: str) -> Data:
    """A ``Data`` object saved with ``torch.save`` (train/test masks made if missing)."""
    data = torch.load(path, weights_only=False)
    if not isinstance(data, Data) and hasattr(data, "__getitem__"):  # a dataset or list
        data = data[0]
    if not isinstance(data, Data):
        raise TypeError(f"{path} holds a {type(data).__name__}, expected torch_geometric Data")
    for attr in ("x", "y", "edge_index"):
        if getattr(data, attr, None) is None:
            raise ValueError(f"{path}: the Data object has no {attr!r}")
    if getattr(data, "train_mask", None) is None or getattr(data, "test_mask", None) is None:
        gen = torch.Generator().manual_seed(0)
        perm = torch.randperm(data.num_nodes, generator=gen)
        data.train_mask = torch.zeros(data.num_nodes, dtype=torch.bool)
        data.train_mask[perm[: int(0.3 * data.num_nodes)]] = True
        data.test_mask = ~data.train_mask
    data.source = f"user data from {path}"
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m act_pyg.bench", description=__doc__)
    parser.add_argument("--model", choices=MODELS, default="gcn")
    parser.add_argument("--level", default="L3", help=f"one of {', '.join(LEVELS)}")
    parser.add_argument("--get-mem", action="store_true", help="measure retained memory")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--random-projection", type=float, default=None, metavar="FRACTION")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=3000, help="planted-partition size")
    parser.add_argument("--data", default=None, help="a torch.save'd torch_geometric Data")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    try:
        level_spec(args.level)
    except ValueError as err:
        parser.error(str(err))
    if args.epochs < 1 or args.seeds < 1:
        parser.error("--epochs and --seeds must be positive")
    data = load_data(args.data) if args.data else planted_partition(num_nodes=args.nodes)
    result = run(
        args.model,
        data,
        level=args.level,
        epochs=args.epochs,
        seeds=range(args.seeds),
        random_projection=args.random_projection,
        get_mem=args.get_mem,
        hidden=args.hidden,
        device=args.device,
    )
    print(format_result(result))
    if args.json:
        payload = asdict(result) | {"torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
