"""Q-layers: drop-in subclasses of torch's layers that save compressed activations.

Each subclasses its torch counterpart (same constructor, parameters, buffers and
``state_dict`` keys; ``isinstance`` still holds) and computes the same forward output.
Without a pending backward (``torch.no_grad``, nothing requires grad) or at a level that
keeps this layer's tensors as they are, it *is* the torch layer: no extra work at all.
``act_level`` (None: the process-wide level) selects the level per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import _ntuple

from ..loss import note_linear_output
from ..op_mode import call_outside_modes
from ..stash import layer_spec, needs_saving, note_output
from .functions import (
    AvgPoolFunction,
    BatchNormFunction,
    ConvFunction,
    DropoutFunction,
    GroupNormFunction,
    LayerNormFunction,
    LinearFunction,
    MaskedActivationFunction,
    MaxPoolFunction,
    RMSNormFunction,
    SyncBatchNormFunction,
    link,
    note_dropout_output,
    note_output_mask,
)

# the Q-layers' API, re-exported by actcore.layers and actcore; LOWER_PRECISION and
# autocast_inputs serve actcore.routing
__all__ = [
    "Q_LAYERS",
    "QAvgPool1d",
    "QAvgPool2d",
    "QAvgPool3d",
    "QBatchNorm1d",
    "QBatchNorm2d",
    "QBatchNorm3d",
    "QBatchNormBase",
    "QConv1d",
    "QConv2d",
    "QConv3d",
    "QConvTranspose1d",
    "QConvTranspose2d",
    "QConvTranspose3d",
    "QDropout",
    "QGroupNorm",
    "QHardtanh",
    "QLayer",
    "QLayerNorm",
    "QLeakyReLU",
    "QLinear",
    "QMaxPool1d",
    "QMaxPool2d",
    "QMaxPool3d",
    "QRMSNorm",
    "QReLU",
    "QReLU6",
    "QSyncBatchNorm",
    "group_norm",
    "register_q_layer",
    "unsupported_reason",
]


class QLayer:
    """Mixin of every Q-layer: its level and per-layer compression state."""

    act_level: str | None = None
    act_scheme: Any = None
    act_adaptive_bits = True  # whether adaptive bit plans (L3) choose its bits

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A Q-layer is its own tailored treatment: the functional-op router of a converted
        # model's scope has nothing to do inside it (and would only add per-call overhead).
        # Under torch.compile it runs eagerly (a graph break): its bookkeeping keys tensors by
        # identity and draws a fresh rounding seed every call, which a trace would freeze.
        return call_outside_modes(super().__call__, args, kwargs)  # type: ignore[misc]

    def _compresses(self, *tensors: torch.Tensor | None) -> bool:
        spec = layer_spec(self)
        return (spec.compresses or spec.swap) and needs_saving(*tensors)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return base if self.act_level is None else f"{base}, act_level={self.act_level!r}"


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a configuration of ``module`` cannot be taken by its Q-layer (None if it can)."""
    if isinstance(module, nn.modules.conv._ConvNd) and module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
        if any(t % 2 for t in totals):
            return "padding='same' with an even receptive field pads asymmetrically"
    if isinstance(module, nn.modules.pooling._MaxPoolNd) and module.return_indices:
        return "return_indices=True hands the int64 indices to the caller"
    return None


# --- autocast: cast inputs as torch's autocast casts them for the torch layer's own op ----

LOWER_PRECISION = "lower"  # conv / linear: autocast's lower-precision list on every device
_PROBES: dict[str, Any] = {
    "batch_norm": lambda t: nn.functional.batch_norm(t, None, None, training=True),
    "layer_norm": lambda t: nn.functional.layer_norm(t, t.shape[-1:]),
    "group_norm": lambda t: nn.functional.group_norm(t, 1),
    "avg_pool1d": lambda t: nn.functional.avg_pool1d(t[:, :, 0, 0], 1),
    "avg_pool2d": lambda t: nn.functional.avg_pool2d(t[:, :, 0], 1),
    "avg_pool3d": lambda t: nn.functional.avg_pool3d(t, 1),
}
_autocast_targets: dict[tuple, torch.dtype | None] = {}


def _autocast_target(op: str, device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs ``op`` in on ``device`` now (None: it leaves inputs alone).

    Conv and linear are autocast's lower-precision ops everywhere; for the others the
    policy differs by device (e.g. layer_norm runs in fp32 on CUDA, as is on CPU), so it
    is read off torch once: the op is run on a tiny tensor of a third floating dtype.
    """
    low = torch.get_autocast_dtype(device.type)
    if op == LOWER_PRECISION:
        return low
    key = (op, device.type, low)
    if key not in _autocast_targets:
        probe_dtype = torch.float16 if low == torch.bfloat16 else torch.bfloat16
        try:
            with torch.no_grad():
                probe = torch.ones(2, 2, 1, 1, 1, dtype=probe_dtype, device=device)
                got = _PROBES[op](probe).dtype
        except RuntimeError:  # no kernel for the probe dtype: assume it runs as it is
            got = probe_dtype
        _autocast_targets[key] = got if got in (low, torch.float32) else None
    return _autocast_targets[key]


def autocast_inputs(op: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` cast as autocast casts the inputs of torch's ``op`` (unchanged when off)."""
    x = tensors[0]
    if not torch.is_autocast_enabled(x.device.type):
        return tensors
    target = _autocast_target(op, x.device)
    if target is None:
        return tensors

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
        return t.to(target) if eligible else t

    return tuple(cast(t) for t in tensors)


def _numeric_padding(module: nn.modules.conv._ConvNd) -> tuple[int, ...]:
    if module.padding == "valid":
        return (0,) * len(module.kernel_size)
    if module.padding == "same":
        return tuple(
            d * (k - 1) // 2 for d, k in zip(module.dilation, module.kernel_size, strict=True)
        )
    return tuple(module.padding)


class _QConvNd(QLayer):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        nd = len(self.kernel_size)
        if self.padding_mode != "zeros":  # torch pads first, then convolves without padding
            input = nn.functional.pad(
                input, self._reversed_padding_repeated_twice, self.padding_mode
            )
            padding = (0,) * nd
        else:
            padding = _numeric_padding(self)
        args = (self.stride, padding, self.dilation, False, (0,) * nd, self.groups)
        input, weight, bias = autocast_inputs(LOWER_PRECISION, input, self.weight, self.bias)
        return ConvFunction.apply(input, weight, bias, self, args, link(input))


class QConv1d(_QConvNd, nn.Conv1d):
    pass


class QConv2d(_QConvNd, nn.Conv2d):
    pass


class QConv3d(_QConvNd, nn.Conv3d):
    pass


class _QConvTransposeNd(QLayer):
    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input, output_size)
        nd = len(self.kernel_size)
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, nd, self.dilation
        )
        args = (self.stride, self.padding, self.dilation, True, output_padding, self.groups)
        input, weight, bias = autocast_inputs(LOWER_PRECISION, input, self.weight, self.bias)
        return ConvFunction.apply(input, weight, bias, self, args, link(input))


class QConvTranspose1d(_QConvTransposeNd, nn.ConvTranspose1d):
    pass


class QConvTranspose2d(_QConvTransposeNd, nn.ConvTranspose2d):
    pass


class QConvTranspose3d(_QConvTransposeNd, nn.ConvTranspose3d):
    pass


class QLinear(QLayer, nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        input, weight, bias = autocast_inputs(LOWER_PRECISION, input, self.weight, self.bias)
        out = LinearFunction.apply(input, weight, bias, self, link(input))
        note_linear_output(out, input, weight, bias, self)  # a cross-entropy can recompute it
        return out


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
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
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

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        input, weight, bias = autocast_inputs("layer_norm", input, self.weight, self.bias)
        return note_output(
            LayerNormFunction.apply(
                input, list(self.normalized_shape), weight, bias, self.eps, self
            )
        )


def _suggest_memory_format(x: torch.Tensor) -> torch.memory_format:
    """The layout ATen's ``suggest_memory_format`` picks (channels-last strides or not)."""
    layouts = {4: torch.channels_last, 5: torch.channels_last_3d}
    layout = layouts.get(x.dim())
    if layout is not None and not x.is_contiguous() and x.is_contiguous(memory_format=layout):
        return layout
    return torch.contiguous_format


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
        input = input.contiguous(memory_format=_suggest_memory_format(input))
    else:
        input = input.contiguous()
    return note_output(GroupNormFunction.apply(input, num_groups, weight, bias, eps, layer))


class QGroupNorm(QLayer, nn.GroupNorm):
    act_adaptive_bits = False  # a row norm: the level's row-norm bits

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps, self)


class QRMSNorm(QLayer, nn.RMSNorm):
    """``nn.RMSNorm`` keeping its normalized input compressed and the exact per-row scale."""

    act_adaptive_bits = False  # a row norm: the level's row-norm bits

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight):
            return super().forward(input)
        return note_output(
            RMSNormFunction.apply(input, list(self.normalized_shape), self.weight, self.eps, self)
        )


class _QMasked(QLayer):
    """Two-valued derivative: a 1-bit mask at every level (exact)."""

    def _kind(self) -> tuple[str, Any]:
        raise NotImplementedError

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not needs_saving(input):
            return super().forward(input)
        kind, param = self._kind()
        out = MaskedActivationFunction.apply(input, kind, param, self.inplace, self)
        return note_output_mask(out) if kind == "relu" else out


class QReLU(_QMasked, nn.ReLU):
    def _kind(self):
        return "relu", None


class QLeakyReLU(_QMasked, nn.LeakyReLU):
    def _kind(self):
        return "leaky_relu", self.negative_slope


class QHardtanh(_QMasked, nn.Hardtanh):
    def _kind(self):
        return "hardtanh", (self.min_val, self.max_val)


class QReLU6(_QMasked, nn.ReLU6):
    def _kind(self):
        return "hardtanh", (self.min_val, self.max_val)


class QDropout(QLayer, nn.Dropout):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and 0 < self.p < 1 and needs_saving(input)):
            return super().forward(input)
        return note_dropout_output(DropoutFunction.apply(input, self.p, self.inplace, self))


def _unsqueezed_1d(fn, input: torch.Tensor, *args) -> torch.Tensor:
    return fn(input.unsqueeze(-2), *args).squeeze(-2)


class _QMaxPoolNd(QLayer):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.return_indices or not needs_saving(input):
            return super().forward(input)
        nd = self._nd
        tup = _ntuple(nd)
        kernel = tup(self.kernel_size)
        stride = tup(self.stride if self.stride is not None else self.kernel_size)
        geometry = (kernel, stride, tup(self.padding), tup(self.dilation))
        if nd == 1:  # torch pools 1-d as 2-d over a unit height
            geometry = tuple((1 if i != 2 else 0, *g) for i, g in enumerate(geometry))
            return _unsqueezed_1d(
                lambda x: MaxPoolFunction.apply(x, *geometry, self.ceil_mode, self), input
            )
        return MaxPoolFunction.apply(input, *geometry, self.ceil_mode, self)


class QMaxPool1d(_QMaxPoolNd, nn.MaxPool1d):
    _nd = 1


class QMaxPool2d(_QMaxPoolNd, nn.MaxPool2d):
    _nd = 2


class QMaxPool3d(_QMaxPoolNd, nn.MaxPool3d):
    _nd = 3


class _QAvgPoolNd(QLayer):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not needs_saving(input):
            return super().forward(input)
        nd = self._nd
        (input,) = autocast_inputs(f"avg_pool{nd}d", input)
        tup = _ntuple(nd)
        kernel = tup(self.kernel_size)
        stride = tup(self.stride if self.stride is not None else self.kernel_size)
        padding = tup(self.padding)
        divisor = getattr(self, "divisor_override", None)
        if nd == 1:
            kernel, stride, padding = (1, *kernel), (1, *stride), (0, *padding)
            return _unsqueezed_1d(
                lambda x: AvgPoolFunction.apply(
                    x, kernel, stride, padding, self.ceil_mode, self.count_include_pad, None, self
                ),
                input,
            )
        return AvgPoolFunction.apply(
            input, kernel, stride, padding, self.ceil_mode, self.count_include_pad, divisor, self
        )


class QAvgPool1d(_QAvgPoolNd, nn.AvgPool1d):
    _nd = 1


class QAvgPool2d(_QAvgPoolNd, nn.AvgPool2d):
    _nd = 2


class QAvgPool3d(_QAvgPoolNd, nn.AvgPool3d):
    _nd = 3


# torch layer -> Q-layer, most specific first (ReLU6 before Hardtanh)
Q_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: QConv1d,
    nn.Conv2d: QConv2d,
    nn.Conv3d: QConv3d,
    nn.ConvTranspose1d: QConvTranspose1d,
    nn.ConvTranspose2d: QConvTranspose2d,
    nn.ConvTranspose3d: QConvTranspose3d,
    nn.Linear: QLinear,
    nn.BatchNorm1d: QBatchNorm1d,
    nn.BatchNorm2d: QBatchNorm2d,
    nn.BatchNorm3d: QBatchNorm3d,
    nn.SyncBatchNorm: QSyncBatchNorm,
    nn.LayerNorm: QLayerNorm,
    nn.GroupNorm: QGroupNorm,
    nn.RMSNorm: QRMSNorm,
    nn.ReLU: QReLU,
    nn.LeakyReLU: QLeakyReLU,
    nn.ReLU6: QReLU6,
    nn.Hardtanh: QHardtanh,
    nn.Dropout: QDropout,
    nn.MaxPool1d: QMaxPool1d,
    nn.MaxPool2d: QMaxPool2d,
    nn.MaxPool3d: QMaxPool3d,
    nn.AvgPool1d: QAvgPool1d,
    nn.AvgPool2d: QAvgPool2d,
    nn.AvgPool3d: QAvgPool3d,
}


def register_q_layer(stock: type[nn.Module], q_layer: type[nn.Module]) -> None:
    """Make :func:`actcore.convert` turn ``stock`` modules (that exact type) into ``q_layer``.

    For layer classes of other libraries (e.g. mmengine's ``_BatchNormXd``). ``q_layer``
    must subclass both ``stock`` and :class:`QLayer` and add no parameters or buffers of
    its own: convert swaps the class of the existing module in place. Registering the
    same pair again is a no-op; another Q-layer for an already mapped ``stock`` is an error.
    """
    for name, cls in (("stock", stock), ("q_layer", q_layer)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"register_q_layer: {name} must be an nn.Module class, got {cls!r}")
    if not (issubclass(q_layer, stock) and issubclass(q_layer, QLayer)):
        raise TypeError(
            f"register_q_layer: {q_layer.__name__} must subclass both "
            f"{stock.__name__} and actcore.layers.QLayer"
        )
    known = Q_LAYERS.get(stock)
    reloaded = known is not None and (known.__module__, known.__qualname__) == (
        q_layer.__module__,
        q_layer.__qualname__,
    )  # the same class from a reloaded module replaces its old self
    if known is not None and known is not q_layer and not reloaded:
        raise ValueError(f"register_q_layer: {stock.__name__} already converts to {known.__name__}")
    Q_LAYERS[stock] = q_layer
