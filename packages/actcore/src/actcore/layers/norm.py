"""Q-layers of normalization: batch (also synchronised across ranks), layer, group and
RMS norm, and ``group_norm``, the functional form the router uses."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .autocast import autocast_inputs
from .base import QLayer
from .memory_format import suggest_memory_format
from .norm_functions import (
    BatchNormFunction,
    GroupNormFunction,
    LayerNormFunction,
    RMSNormFunction,
    SyncBatchNormFunction,
)
from .stash import note_output

__all__ = [
    "QBatchNorm1d",
    "QBatchNorm2d",
    "QBatchNorm3d",
    "QBatchNormBase",
    "QGroupNorm",
    "QLayerNorm",
    "QRMSNorm",
    "QSyncBatchNorm",
    "group_norm",
]


class QBatchNormBase(QLayer):
    """Compressed batch norm over any ``nn.modules.batchnorm._BatchNorm`` subclass.

    Combine it with a batch-norm class to get its Q-layer, e.g.
    ``class QMyBN(QBatchNormBase, MyBN)`` (what :class:`QBatchNorm2d` is for
    ``nn.BatchNorm2d``), then :func:`register_q_layer` it.
    """

    def _momentum_factor(self) -> float:
        """The running-statistics factor torch's batch norm uses this step (counts the step)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias) or input.numel() == 0:
            return super().forward(input)  # (an empty batch: torch's empty output, nothing kept)
        self._check_input_dim(input)
        factor = self._momentum_factor()
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_running = not self.training or self.track_running_stats
        if use_batch_stats and input.numel() // input.shape[1] == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {input.size()}"
            )
        input, weight, bias = autocast_inputs("batch_norm", input, self.weight, self.bias)
        return BatchNormFunction.apply(
            input,
            weight,
            bias,
            self.running_mean if keep_running else None,
            self.running_var if keep_running else None,
            use_batch_stats,
            factor,
            self.eps,
            self,
        )


class QBatchNorm1d(QBatchNormBase, nn.BatchNorm1d):
    pass


class QBatchNorm2d(QBatchNormBase, nn.BatchNorm2d):
    pass


class QBatchNorm3d(QBatchNormBase, nn.BatchNorm3d):
    pass


class QSyncBatchNorm(QBatchNormBase, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` with a compressed input; statistics synchronised across ranks.

    Without synchronisation (one process, no process group, eval mode) it is
    :class:`QBatchNorm2d`'s computation, as torch falls back to plain batch norm. When
    synchronising, it gathers per-rank mean / sum of squared deviations / count (an exact
    parallel combination) and all-reduces the two per-channel gradient sums in backward,
    through ``torch.distributed`` collectives: unlike torch's it also runs on CPU (gloo).
    """

    def _sync_group(self) -> tuple[Any, int] | None:
        import torch.distributed as dist

        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        world = dist.get_world_size(group)
        return (group, world) if world > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        sync = self._sync_group()
        if sync is None:
            return super().forward(input)
        self._check_input_dim(input)
        factor = self._momentum_factor()
        input, weight, bias = autocast_inputs("batch_norm", input, self.weight, self.bias)
        return SyncBatchNormFunction.apply(
            input,
            weight,
            bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            factor,
            self.eps,
            sync,
            self,
        )


class QLayerNorm(QLayer, nn.LayerNorm):
    act_adaptive_bits = False  # a row norm: the level's row-norm bits
    act_recompute_output = True  # (under Dynamo: see QLayer.__call__)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        input, weight, bias = autocast_inputs("layer_norm", input, self.weight, self.bias)
        return note_output(
            LayerNormFunction.apply(
                input, list(self.normalized_shape), weight, bias, self.eps, self
            )
        )


def group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    layer: Any,
) -> torch.Tensor:
    """``F.group_norm`` (same output) keeping a compressed normalized input for ``layer``."""
    input, weight, bias = autocast_inputs("group_norm", input, weight, bias)
    if input.device.type == "cpu":  # the layout torch's group_norm hands its kernel
        input = input.contiguous(memory_format=suggest_memory_format(input))
    else:
        input = input.contiguous()
    return note_output(GroupNormFunction.apply(input, num_groups, weight, bias, eps, layer))


class QGroupNorm(QLayer, nn.GroupNorm):
    act_adaptive_bits = False  # a row norm: the level's row-norm bits
    act_recompute_output = True  # (under Dynamo: see QLayer.__call__)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps, self)


class QRMSNorm(QLayer, nn.RMSNorm):
    """``nn.RMSNorm`` keeping its normalized input compressed and the exact per-row scale."""

    act_adaptive_bits = False  # a row norm: the level's row-norm bits
    act_recompute_output = True  # (under Dynamo: see QLayer.__call__)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight):
            return super().forward(input)
        return note_output(
            RMSNormFunction.apply(input, list(self.normalized_shape), self.weight, self.eps, self)
        )
