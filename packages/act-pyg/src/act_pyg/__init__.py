"""act_pyg: the PyTorch Geometric adapter of ACT (activation-compressed training).

``act_pyg.convert(gnn, level="L3", random_projection=None)`` makes a PyG model keep
compressed activations for backward: GCNConv, SAGEConv, GATConv and GINConv become
converted subclasses (same parameters and outputs; quantized node features, narrow shared
edge indices, no ``E x C`` messages kept), the MLP parts (``nn.Linear``, PyG's ``Linear``,
norms, activations) become actcore's Q-layers, and everything else the forward saves
(other message-passing layers, functional ``F.relu`` / ``F.dropout`` between the convs) is
compressed by the scope actcore attaches to the model's forward. ``python -m
act_pyg.bench`` measures it.
"""

from __future__ import annotations

from .convert import ConversionReport, convert
from .convs import QGATConv, QGCNConv, QGINConv, QMessagePassing, QSAGEConv
from .linear import QPyGLinear

__version__ = "0.1.0"

__all__ = [
    "ConversionReport",
    "QGATConv",
    "QGCNConv",
    "QGINConv",
    "QMessagePassing",
    "QPyGLinear",
    "QSAGEConv",
    "__version__",
    "convert",
]
