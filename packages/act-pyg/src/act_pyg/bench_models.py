"""The benchmark's GNNs: 2-layer GCN, SAGE, GAT and GIN, with activations and dropout as
modules (:class:`GNN`) or written as PyG's examples write them (:data:`EXAMPLES`)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import MLP, GATConv, GCNConv, GINConv, SAGEConv

__all__ = [
    "EXAMPLES",
    "EXAMPLE_ACT",
    "GNN",
    "MODELS",
    "STYLES",
    "ExampleGAT",
    "ExampleGCN",
    "ExampleGIN",
    "ExampleSAGE",
    "build_model",
    "make_model",
]

MODELS = ("gcn", "sage", "gat", "gin")
STYLES = ("module", "example")
"""``module``: activations and dropout as modules (:class:`GNN`); ``example``: written as
PyG's examples write them, with ``F.relu`` / ``F.elu`` / ``F.dropout`` in ``forward``
(:data:`EXAMPLES`)."""


def _gin_mlp(in_channels: int, hidden: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_channels, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, out_channels),
    )


def _check_kind(kind: str) -> None:
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; valid models: {', '.join(MODELS)}")


class GNN(nn.Module):
    """dropout -> conv -> activation -> dropout -> conv, as modules (all of it converted).

    ``act``: ``"relu"`` or ``"elu"`` (as an ``nn`` module). GIN's convs hold a
    Linear-BatchNorm-ReLU-Linear MLP.
    """

    def __init__(
        self,
        kind: str,
        in_channels: int,
        hidden: int,
        out_channels: int,
        heads: int = 4,
        dropout: float = 0.5,
        act: str = "relu",
    ) -> None:
        super().__init__()
        _check_kind(kind)
        self.kind = kind
        if kind == "gcn":
            self.conv1 = GCNConv(in_channels, hidden)
            self.conv2 = GCNConv(hidden, out_channels)
        elif kind == "sage":
            self.conv1 = SAGEConv(in_channels, hidden)
            self.conv2 = SAGEConv(hidden, out_channels)
        elif kind == "gat":
            self.conv1 = GATConv(in_channels, hidden // heads, heads=heads, dropout=dropout)
            self.conv2 = GATConv(hidden, out_channels, heads=1, dropout=dropout)
        else:
            self.conv1 = GINConv(_gin_mlp(in_channels, hidden, hidden))
            self.conv2 = GINConv(_gin_mlp(hidden, hidden, out_channels))
        self.drop_in = nn.Dropout(dropout)
        self.act = {"relu": nn.ReLU, "elu": nn.ELU}[act]()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = self.drop_in(x)
        x = self.drop(self.act(self.conv1(x, edge_index)))
        return self.conv2(x, edge_index)


# ---- the same models written the way PyG's examples write theirs ----------------------------


class ExampleGCN(nn.Module):
    """GCN with functional dropout and ``Tensor.relu`` between the convs."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float = 0.5):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden)
        self.conv2 = GCNConv(hidden, out_channels)
        self.dropout = dropout

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = self.conv1(x, edge_index).relu()
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


class ExampleSAGE(nn.Module):
    """GraphSAGE as a loop over a ``ModuleList``, ``F.relu`` and ``F.dropout`` inside it."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float = 0.5):
        super().__init__()
        self.convs = nn.ModuleList([SAGEConv(in_channels, hidden), SAGEConv(hidden, out_channels)])
        self.dropout = dropout

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=self.dropout, training=self.training)
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i + 1 < len(self.convs):
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


class ExampleGAT(nn.Module):
    """GAT with ``F.elu`` and ``F.dropout`` (attention dropout inside the convs)."""

    def __init__(
        self, in_channels: int, hidden: int, out_channels: int, heads: int = 4, dropout=0.5
    ):
        super().__init__()
        self.conv1 = GATConv(in_channels, hidden // heads, heads=heads, dropout=dropout)
        self.conv2 = GATConv(hidden, out_channels, heads=1, dropout=dropout)
        self.dropout = dropout

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


class ExampleGIN(nn.Module):
    """GIN whose convs hold PyG's ``MLP`` (Linear, batch norm, ReLU, Linear); ``F.relu``."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float = 0.5):
        super().__init__()
        self.conv1 = GINConv(MLP([in_channels, hidden, hidden]))
        self.conv2 = GINConv(MLP([hidden, hidden, out_channels]))
        self.dropout = dropout

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


EXAMPLES: dict[str, type[nn.Module]] = {
    "gcn": ExampleGCN,
    "sage": ExampleSAGE,
    "gat": ExampleGAT,
    "gin": ExampleGIN,
}
EXAMPLE_ACT = {"gat": "elu"}  # the activation of each example (the module twin's ``act``)


def make_model(
    kind: str,
    in_channels: int,
    hidden: int,
    out_channels: int,
    *,
    style: str = "module",
    heads: int = 4,
    dropout: float = 0.5,
    act: str | None = None,
) -> nn.Module:
    """``kind`` in ``style``; a module-style model takes ``act`` (default: ReLU)."""
    _check_kind(kind)
    if style == "example":
        extra = {"heads": heads} if kind == "gat" else {}
        return EXAMPLES[kind](in_channels, hidden, out_channels, dropout=dropout, **extra)
    if style != "module":
        raise ValueError(f"unknown style {style!r}; valid styles: {', '.join(STYLES)}")
    return GNN(kind, in_channels, hidden, out_channels, heads, dropout, act or "relu")


def build_model(
    kind: str,
    data: Data,
    hidden: int = 64,
    heads: int = 4,
    dropout: float = 0.5,
    style: str = "module",
) -> nn.Module:
    """``kind`` in ``style`` for ``data``'s features and classes."""
    classes = int(data.y.max()) + 1 if getattr(data, "y", None) is not None else 8
    return make_model(
        kind, data.num_features, hidden, classes, style=style, heads=heads, dropout=dropout
    )
