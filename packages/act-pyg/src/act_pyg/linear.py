"""PyG's own ``Linear`` (``torch_geometric.nn.Linear``) as an actcore Q-layer.

PyG builds its convs' transforms and its ``MLP`` from this class, not from ``nn.Linear``.
Registered with :func:`actcore.layers.register_q_layer` on import, so every conversion
(``act_pyg.convert``, ``actcore.convert``) swaps it for :class:`QPyGLinear`, which keeps its
input as actcore's ``QLinear`` does (at the level's conv/linear bits, adaptive at L3).
Its input is often graph-less (node features after dropout, when the features need no
gradient), which the model scope's saved-tensor hooks would keep exact as a constant of
the forward; here it is compressed like any other linear input.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn.parameter import UninitializedParameter
from torch_geometric.nn.dense.linear import Linear

from actcore.extend import (  # (LOWER_PRECISION, autocast_inputs: QLinear's autocast casts)
    LOWER_PRECISION,
    LinearFunction,
    QLayer,
    autocast_inputs,
    register_q_layer,
)

__all__ = ["QPyGLinear"]


class QPyGLinear(QLayer, Linear):
    """``torch_geometric.nn.Linear`` keeping its input compressed; same output."""

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.weight, UninitializedParameter) or not self._compresses(
            x, self.weight, self.bias
        ):
            return super().forward(x)
        x, weight, bias = autocast_inputs(LOWER_PRECISION, x, self.weight, self.bias)
        return LinearFunction.apply(x, weight, bias, self)


register_q_layer(Linear, QPyGLinear)
