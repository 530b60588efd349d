"""act_pyg: the PyTorch Geometric adapter of ACT (activation-compressed training).

Skeleton package. ``act_pyg.convert(gnn, ...)`` for GCNConv, SAGEConv and GATConv (with
the message tensor compressed too), the random projection option and a GNN memory
benchmark land in their own issue.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
