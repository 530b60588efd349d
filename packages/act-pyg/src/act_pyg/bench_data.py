"""The benchmark's graphs: a planted-partition graph that builds offline from a seed, a
uniform random graph for memory measurements, and a user's saved ``Data``."""

from __future__ import annotations

import torch
from torch_geometric.data import Data

__all__ = ["PLANTED", "SMALL_GRAPH", "load_data", "planted_partition", "random_graph"]

# The quick configuration's graph (the accuracy test; SMALL_RUN in act_pyg.bench).
SMALL_GRAPH = {"num_nodes": 800, "num_features": 32, "num_classes": 4}
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
