"""Compressed GCNConv, SAGEConv and GATConv: subclasses with the stock parameters and output.

:func:`act_pyg.convert` swaps a conv's class for its subclass here (the object, parameters,
``state_dict`` keys and hooks stay). Each computes the stock forward output and keeps for
backward only compressed node features, the narrow shared edge index and, for GAT, the
quantized attention coefficients and 1-bit masks (see :mod:`act_pyg.functions`).

GCN and SAGE also take a torch_sparse ``SparseTensor`` adjacency (``adj_t``, with
torch_sparse installed): the forward is the stock sparse product, and backward keeps the
adjacency's indices as a shared int32 edge index plus its values, as for ``edge_index``.
Inputs these paths do not cover (GAT with a ``SparseTensor``, a torch sparse adjacency,
bipartite tuples, ``size``, edge features, ``return_attention_weights``, a learnable
``edge_weight``, a lazy linear not yet initialised, ``explain`` or ``decomposed_layers``)
run the stock forward under the saved-tensor hooks route instead; without a pending backward
(``no_grad``, inference) they run the stock forward as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch_geometric.nn import GATConv, GCNConv, GINConv, MessagePassing, SAGEConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import add_self_loops, remove_self_loops

import actcore
from actcore.extend import ConvertedLayer, needs_saving

from .functions import GATAttention, LinearAggregation, linear
from .graph import Graph, shared_graph

LINEAR_AGGRS = ("add", "sum", "mean")


def _lazy(lin: Any) -> bool:
    return lin is not None and isinstance(lin.weight, torch.nn.parameter.UninitializedParameter)


def _plain_index(edge_index: Any) -> bool:
    return (
        isinstance(edge_index, Tensor)
        and edge_index.layout == torch.strided
        and edge_index.dim() == 2
        and edge_index.shape[0] == 2
        and not edge_index.is_floating_point()
    )


def _adjacency(edge_index: Any, flow: str) -> bool:
    """A torch_sparse ``SparseTensor`` adjacency the converted GCN/SAGE paths take."""
    if not isinstance(edge_index, SparseTensor) or flow != "source_to_target":
        return False
    value = edge_index.storage.value()
    return value is None or not value.requires_grad


def _adjacency_graph(tag: Any, adj_in: Any, adj: Any, num_nodes: int) -> Graph:
    """Backward's shared narrow edge index (source, target) and weights of ``adj``, the
    processed form of the input adjacency ``adj_in`` (``adj[i, j]``: edge ``j -> i``)."""
    st = adj_in.storage
    inputs = (st.row(), st.col(), st.value())  # row(): built once, then kept by the storage

    def build() -> tuple[Tensor, Tensor | None]:
        return torch.stack([adj.storage.col(), adj.storage.row()]), adj.storage.value()

    return shared_graph(("adj", tag), inputs, num_nodes, build)


def _unit_graph(x: Tensor, edge_index: Any) -> tuple[Graph, Any]:
    """Backward's graph and the forward's index for a conv that sums or averages its
    neighbours with unit weights (SAGE, GIN: they drop a ``SparseTensor``'s values)."""
    n = x.size(0)
    if isinstance(edge_index, SparseTensor):
        unit = edge_index.set_value(None, layout=None)
        return _adjacency_graph(("unit",), edge_index, unit, n), edge_index
    graph = shared_graph(("plain",), (edge_index,), n, lambda: (edge_index, None))
    return graph, graph.edge_index


class QMessagePassing(ConvertedLayer):
    """Mixin of the converted convs: level, random projection and attention bits."""

    act_projection: float | None = None  # kept fraction of the linear input's features
    act_attention_bits: int | None = None  # GAT's attention coefficients (None: level bits)

    def _runtime_reason(self) -> str | None:
        if getattr(self, "_explain", None):
            return "explain is on"
        if getattr(self, "decomposed_layers", 1) > 1:
            return "decomposed_layers > 1"
        return None

    def _stock(self, *args: Any, **kwargs: Any) -> Any:
        """The stock forward (inside a converted model's forward, the model's scope
        compresses what it saves, as for any other op)."""
        return super().forward(*args, **kwargs)  # type: ignore[misc]


def _unit_path(conv: MessagePassing, x: Any, edge_index: Any, size: Any) -> bool:
    """Whether a SAGE or GIN call takes the compressed unit-weight aggregation: node
    features ``x`` as one 2-D tensor, a plain or adjacency ``edge_index``, no ``size``,
    a linear aggregation, nothing at run time against it."""
    return (
        isinstance(x, Tensor)
        and x.dim() == 2
        and size is None
        and (_plain_index(edge_index) or _adjacency(edge_index, conv.flow))
        and conv.aggr in LINEAR_AGGRS
        and not conv._runtime_reason()
    )


def _unit_aggregate(conv: MessagePassing, x: Tensor, edge_index: Any) -> Tensor:
    """``x`` summed or averaged over each node's neighbours with unit weights (SAGE, GIN),
    backward keeping only the shared edge index."""
    graph, forward_index = _unit_graph(x, edge_index)
    return LinearAggregation.apply(
        x,
        conv,
        graph,
        conv.aggr == "mean",
        conv.flow,
        lambda t: conv.propagate(forward_index, x=(t, t), size=None),
    )


def _pending_backward(module: torch.nn.Module, x: Any) -> bool:
    """Whether autograd will want a backward through this call (else: the stock forward)."""
    xs = x if isinstance(x, (tuple, list)) else (x,)
    tensors = [t for t in xs if isinstance(t, Tensor)]
    return needs_saving(*tensors, *(p for p in module.parameters() if p.requires_grad))


class QGCNConv(QMessagePassing, GCNConv):
    """GCNConv that keeps ``x`` quantized and the normalised edge index narrow and shared."""

    def forward(self, x: Tensor, edge_index: Any, edge_weight: Tensor | None = None) -> Tensor:
        if not _pending_backward(self, x):
            return super().forward(x, edge_index, edge_weight)
        adjacency = _adjacency(edge_index, self.flow)
        if (
            not isinstance(x, Tensor)
            or x.dim() != 2
            or not (_plain_index(edge_index) or adjacency)
            or (edge_weight is not None and (edge_weight.requires_grad or adjacency))
            or _lazy(self.lin)
            or self.aggr not in LINEAR_AGGRS
            or self._runtime_reason()
        ):
            return self._stock(x, edge_index, edge_weight)
        if adjacency:
            adj = self._adjacency(x, edge_index)
            graph = _adjacency_graph(
                ("gcn", self.normalize, self.improved, self.add_self_loops, x.dtype),
                edge_index,
                adj,
                x.size(self.node_dim),
            )

            def compute(t: Tensor) -> Tensor:
                return self.propagate(adj, x=t, edge_weight=None)
        else:
            graph = self._graph(x, edge_index, edge_weight)

            def compute(t: Tensor) -> Tensor:
                return self.propagate(graph.edge_index, x=t, edge_weight=graph.weight)

        h = linear(self, self.lin, x)
        out = LinearAggregation.apply(h, self, graph, self.aggr == "mean", self.flow, compute)
        if self.bias is not None:
            out = out + self.bias
        return out

    def _adjacency(self, x: Tensor, adj_t: Any) -> Any:
        """The adjacency the stock forward propagates over (normalised and cached as it does)."""
        if not self.normalize:
            return adj_t
        if self._cached_adj_t is not None:
            return self._cached_adj_t
        adj = gcn_norm(
            adj_t,
            None,
            x.size(self.node_dim),
            self.improved,
            self.add_self_loops,
            self.flow,
            x.dtype,
        )
        if self.cached:
            self._cached_adj_t = adj
        return adj

    def _graph(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor | None) -> Graph:
        n = x.size(self.node_dim)
        if not self.normalize:
            return shared_graph(
                ("plain",), (edge_index, edge_weight), n, lambda: (edge_index, edge_weight)
            )
        cache = self._cached_edge_index
        if cache is not None:
            return shared_graph(("plain",), (cache[0], cache[1]), n, lambda: (cache[0], cache[1]))
        tag = ("gcn", self.improved, self.add_self_loops, self.flow, x.dtype)
        graph = shared_graph(
            tag,
            (edge_index, edge_weight),
            n,
            lambda: gcn_norm(
                edge_index, edge_weight, n, self.improved, self.add_self_loops, self.flow, x.dtype
            ),
        )
        if self.cached:
            self._cached_edge_index = (graph.edge_index, graph.weight)
        return graph


class QSAGEConv(QMessagePassing, SAGEConv):
    """SAGEConv (mean or sum aggregation): ``x`` and the aggregate kept quantized."""

    def forward(self, x: Any, edge_index: Any, size: Any = None) -> Tensor:
        if not _pending_backward(self, x):
            return super().forward(x, edge_index, size)
        if (
            not _unit_path(self, x, edge_index, size)
            or self.project
            or self.normalize
            or _lazy(self.lin_l)
            or (self.root_weight and _lazy(self.lin_r))
        ):
            return self._stock(x, edge_index, size)
        out = linear(self, self.lin_l, _unit_aggregate(self, x, edge_index))
        if self.root_weight:
            out = out + linear(self, self.lin_r, x)
        return out


class QGINConv(QMessagePassing, GINConv):
    """GINConv (sum or mean): the aggregation keeps only the shared edge index; its MLP
    (actcore's Q-layers after :func:`act_pyg.convert`) keeps its own inputs compressed."""

    def forward(self, x: Any, edge_index: Any, size: Any = None) -> Tensor:
        if not _pending_backward(self, x):
            return super().forward(x, edge_index, size)
        if not _unit_path(self, x, edge_index, size):
            return self._stock(x, edge_index, size)
        out = _unit_aggregate(self, x, edge_index) + (1 + self.eps) * x
        return self.nn(out)


def _gat_graph(conv: GATConv, edge_index: Tensor, n: int) -> Graph:
    if not conv.add_self_loops:
        return shared_graph(("plain",), (edge_index,), n, lambda: (edge_index, None))

    def build() -> tuple[Tensor, None]:
        ei, _ = remove_self_loops(edge_index, None)
        ei, _ = add_self_loops(ei, None, fill_value=conv.fill_value, num_nodes=n)
        return ei, None

    return shared_graph(("gat-loops",), (edge_index,), n, build)


class QGATConv(QMessagePassing, GATConv):
    """GATConv: no ``E x H x C`` messages kept; attention coefficients quantized."""

    def forward(
        self,
        x: Any,
        edge_index: Any,
        edge_attr: Tensor | None = None,
        size: Any = None,
        return_attention_weights: bool | None = None,
    ) -> Any:
        args = (x, edge_index, edge_attr, size, return_attention_weights)
        if not _pending_backward(self, x):
            return super().forward(*args)
        if not (self.act_spec or actcore.config.spec).compresses:
            # nothing to compress: PyG's own forward, so gradients are bitwise PyG's too
            # (the fused attention backward reorders sums)
            return self._stock(*args)
        if (
            not isinstance(x, Tensor)
            or x.dim() != 2
            or not _plain_index(edge_index)
            or edge_attr is not None
            or size is not None
            or return_attention_weights is not None
            or self.lin is None
            or _lazy(self.lin)
            or getattr(self, "lin_edge", None) is not None
            or self._runtime_reason()
        ):
            return self._stock(*args)
        heads, channels = self.heads, self.out_channels
        res_lin = getattr(self, "res", None)
        res = linear(self, res_lin, x) if res_lin is not None else None
        h = linear(self, self.lin, x).view(-1, heads, channels)
        graph = _gat_graph(self, edge_index, h.size(0))
        out = GATAttention.apply(
            h,
            self.att_src,
            self.att_dst,
            self,
            graph,
            lambda t, a: self.propagate(graph.edge_index, x=(t, t), alpha=a, size=None),
        )
        out = out.view(-1, heads * channels) if self.concat else out.mean(dim=1)
        if res is not None:
            out = out + res
        if self.bias is not None:
            out = out + self.bias
        return out


CONVERTED: dict[type[MessagePassing], type[MessagePassing]] = {
    GCNConv: QGCNConv,
    SAGEConv: QSAGEConv,
    GATConv: QGATConv,
    GINConv: QGINConv,
}


def unsupported_reason(module: MessagePassing) -> str | None:
    """Why ``module``'s configuration cannot take its converted class (None if it can)."""
    if isinstance(module, (GCNConv, GINConv)) and module.aggr not in LINEAR_AGGRS:
        return f"aggr={module.aggr!r} is not a linear aggregation"
    if isinstance(module, SAGEConv):
        if module.aggr not in LINEAR_AGGRS:
            return f"aggr={module.aggr!r} is not a linear aggregation"
        if module.project:
            return "project=True (a ReLU-projected input)"
        if module.normalize:
            return "normalize=True (L2-normalised output)"
    if isinstance(module, GATConv):
        if module.lin is None:
            return "bipartite in_channels (separate source/target transforms)"
        if getattr(module, "lin_edge", None) is not None:
            return "edge_dim (edge features in the attention)"
    return None
