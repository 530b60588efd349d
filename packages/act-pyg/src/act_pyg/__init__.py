"""act_pyg: the PyTorch Geometric adapter of ACT (activation-compressed training).

``act_pyg.convert(gnn, level="L3", random_projection=None)`` makes a PyG model keep
compressed activations for backward: GCNConv, SAGEConv and GATConv become converted
subclasses (same parameters and outputs; quantized node features, narrow shared edge
indices, no ``E x C`` messages kept), other message-passing layers run under saved-tensor
hooks, and the MLP parts become actcore's Q-layers. ``python -m act_pyg.bench`` measures it.
"""

from __future__ import annotations

from .convert import ConversionReport, convert
from .convs import QGATConv, QGCNConv, QMessagePassing, QSAGEConv

__version__ = "0.1.0"

__all__ = [
    "ConversionReport",
    "QGATConv",
    "QGCNConv",
    "QMessagePassing",
    "QSAGEConv",
    "__version__",
    "convert",
]
