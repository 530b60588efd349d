"""Functional ops routed to the layer-swap route's tailored autograd functions.

Inside a converted model's forward (see :mod:`actcore.layers.scope`), :class:`FunctionalRouter`
hands these Python-level calls, when they save tensors for backward, to the same autograd
functions the Q-layers use, so code written with functionals is compressed as modules are:

=====================================================  ========================================
calls                                                   what is kept for backward
=====================================================  ========================================
``F.relu``, ``torch.relu``, ``Tensor.relu`` (and the    a 1-bit mask (exact); a ReLU output
in-place forms), ``F.relu6``, ``F.hardtanh``,           that the next layer saves keeps only
``F.leaky_relu``                                        its nonzeros beside that mask
``F.hardsigmoid``, ``F.threshold``,                     a 1-bit mask (exact)
``F.hardshrink``, ``F.softshrink``
``F.dropout``, ``torch.dropout`` (training)             the keep mask at 1 bit
``F.gelu``, ``F.silu``, ``F.hardswish``, ``F.mish``,    a ``fewbit_bits``-bit derivative code
``F.elu``, ``F.celu``, ``F.selu``, ``F.softplus``,      (FewBit); with ``fewbit_bits=None``
``F.logsigmoid``, ``F.softsign``, ``F.tanhshrink``,     the input at the level's activation
``torch.sigmoid``, ``torch.tanh`` (and ``F.``,          bits, the call rerun in backward
``Tensor.`` forms)                                      (or its derivative kept, with
                                                        ``config.keep_derivatives``)
``F.layer_norm``, ``F.group_norm``, ``F.batch_norm``,   the normalized input at the level's
``F.rms_norm``                                          norm bits, exact statistics
``F.cross_entropy`` (class indices)                     the head linear's input and weight, to
                                                        recompute the logits exactly (else the
                                                        logits at 8 bits;
                                                        :mod:`actcore.layers.loss`)
``F.scaled_dot_product_attention``,                     q, k, v at the level's bits; backward
``F.multi_head_attention_forward``                      reruns the same kernel on them
(``nn.MultiheadAttention``)                             (:mod:`actcore.layers.attention`,
                                                        :mod:`actcore.layers.multihead`)
=====================================================  ========================================

Every routed call computes its output with the very torch op it replaces, so forward
outputs are bitwise unchanged. Calls that save nothing (no grad, no input requiring grad),
tensor subclasses, and arguments the tailored functions do not take go through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LevelSpec, config
from ..fewbit import functional as FB
from ..saved_tensors.op_mode import plain_float, wants_grad
from .base import ConvertedLayer
from .derivative import keep_derivative
from .loss import ROW_FUNCS, note_rows
from .recompute import recompute
from .roles import NORMALIZED
from .stash import derive_from, in_checkpoint, note_output

aten = torch.ops.aten

__all__ = ["AttentionRouter", "FunctionalLayer", "FunctionalRouter"]

_Handler = Callable[["FunctionalRouter", tuple, dict], Any]


class FunctionalLayer(ConvertedLayer):
    """What a routed functional call is to the stash: a level and a name, no weights."""

    def __init__(self, spec: LevelSpec, name: str = "<functional>") -> None:
        self.act_spec = spec
        self.act_name = name


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _saves(x: Any) -> bool:
    """Whether ``x`` is a plain floating tensor whose op will save something for backward."""
    return plain_float(x) and wants_grad(x)


# ---- ReLU family: the Q-layers' masked activation ------------------------------------------


def _masked(kind: str, param_of: Callable[[tuple, dict], Any], inplace_of: Callable) -> _Handler:
    def handle(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
        from .masked_functions import MaskedActivationFunction, note_output_mask

        x = args[0] if args else kwargs.get("input")
        if not _saves(x):
            return NotImplemented
        param = param_of(args, kwargs)
        out = MaskedActivationFunction.apply(x, kind, param, inplace_of(args, kwargs), router.layer)
        return note_output_mask(out) if kind == "relu" else out

    return handle


def _no_param(args: tuple, kwargs: dict) -> None:
    return None


def _inplace_arg(index: int) -> Callable[[tuple, dict], bool]:
    return lambda args, kwargs: bool(_arg(args, kwargs, index, "inplace", False))


def _always_inplace(args: tuple, kwargs: dict) -> bool:
    return True


def _never_inplace(args: tuple, kwargs: dict) -> bool:
    return False


def _hardtanh_range(args: tuple, kwargs: dict) -> tuple[float, float]:
    return (
        float(_arg(args, kwargs, 1, "min_val", -1.0)),
        float(_arg(args, kwargs, 2, "max_val", 1.0)),
    )


def _relu6_range(args: tuple, kwargs: dict) -> tuple[float, float]:
    return (0.0, 6.0)


def _slope(args: tuple, kwargs: dict) -> float:
    return float(_arg(args, kwargs, 1, "negative_slope", 0.01))


# ---- few-bit derivative codes ----------------------------------------------------------------


def _fewbit(fn: Callable[..., Tensor], names: tuple[str, ...], smooth: bool = True) -> _Handler:
    """Route to ``fn(input, *params, bits=...)``; ``names``: torch's parameters after input."""

    def handle(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else kwargs.get("input")
        if not _saves(x):
            return NotImplemented
        unknown = set(kwargs) - {"input", *names}
        if unknown or len(args) > 1 + len(names):
            return NotImplemented
        params = {n: kwargs[n] for n in names if n in kwargs}
        params.update(zip(names, args[1:], strict=False))
        bits = router.fewbit_bits if smooth else 1
        if bits is not None:
            return fn(x, **params, bits=bits)
        in_place = params.pop("inplace", False)
        if router.spec.conv_bits is None or (in_place and config.keep_derivatives):
            return NotImplemented
        name = fn.__name__
        torch_fn = getattr(torch, name) if name in ("sigmoid", "tanh") else getattr(F, name)
        if config.keep_derivatives:
            return keep_derivative(x, lambda t: torch_fn(t, **params), router.layer)
        found = _INPUT_DERIVATIVES.get(name)
        derivative = None if found is None else (lambda g, t: found(g, t, params))
        writer = (lambda t: torch_fn(t, **params, inplace=True)) if in_place else None
        return recompute(x, lambda t: torch_fn(t, **params), router.layer, derivative, writer)

    return handle


# The input gradients of activations whose backward op reads only the input (autograd's own
# formula for each, outside create_graph): a recomputed activation's backward calls it
# instead of rerunning the forward to differentiate it.
_INPUT_DERIVATIVES: dict[str, Callable[[Tensor, Tensor, dict], Tensor]] = {
    "gelu": lambda g, x, p: aten.gelu_backward(g, x, approximate=p.get("approximate", "none")),
    "silu": lambda g, x, p: aten.silu_backward(g, x),
    "mish": lambda g, x, p: aten.mish_backward(g, x),
    "hardswish": lambda g, x, p: aten.hardswish_backward(g, x),
    "softplus": lambda g, x, p: aten.softplus_backward(
        g, x, p.get("beta", 1.0), p.get("threshold", 20.0)
    ),
}


# ---- normalization: the Q-layers' normalized-input scheme ----------------------------------


def _affine_norm_args(router: FunctionalRouter, args: tuple, kwargs: dict) -> tuple | None:
    """``(input, weight, bias)`` of ``F.layer_norm``/``F.group_norm`` when they are routed."""
    x = args[0] if args else kwargs.get("input")
    weight = _arg(args, kwargs, 2, "weight", None)
    bias = _arg(args, kwargs, 3, "bias", None)
    if not router.compresses_norms or not (_saves(x) or wants_grad(weight, bias)):
        return None
    return (x, weight, bias) if plain_float(x) else None


def _layer_norm(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .autocast import autocast_inputs
    from .norm_functions import LayerNormFunction

    found = _affine_norm_args(router, args, kwargs)
    if found is None:
        return NotImplemented
    shape = list(_arg(args, kwargs, 1, "normalized_shape", None))
    eps = float(_arg(args, kwargs, 4, "eps", 1e-5))
    x, weight, bias = autocast_inputs("layer_norm", *found)
    return note_output(LayerNormFunction.apply(x, shape, weight, bias, eps, router.layer))


def _group_norm(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .norm import group_norm

    found = _affine_norm_args(router, args, kwargs)
    if found is None or found[0].dim() < 2:
        return NotImplemented
    groups = int(_arg(args, kwargs, 1, "num_groups", None))
    if found[0].shape[1] % groups:
        return NotImplemented  # torch raises its own error
    eps = float(_arg(args, kwargs, 4, "eps", 1e-5))
    return group_norm(*found[:1], groups, *found[1:], eps, router.layer)


def _batch_norm(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .autocast import autocast_inputs
    from .norm_functions import BatchNormFunction

    x = args[0] if args else kwargs.get("input")
    running_mean = _arg(args, kwargs, 1, "running_mean", None)
    running_var = _arg(args, kwargs, 2, "running_var", None)
    weight = _arg(args, kwargs, 3, "weight", None)
    bias = _arg(args, kwargs, 4, "bias", None)
    training = bool(_arg(args, kwargs, 5, "training", False))
    momentum = float(_arg(args, kwargs, 6, "momentum", 0.1))
    eps = float(_arg(args, kwargs, 7, "eps", 1e-5))
    if not router.compresses_norms or not (_saves(x) or wants_grad(weight, bias)):
        return NotImplemented
    if not plain_float(x) or x.dim() < 2:
        return NotImplemented
    if training:
        if x.numel() // x.shape[1] <= 1:
            return NotImplemented  # torch raises its own error
    elif running_mean is None or running_var is None:
        return NotImplemented
    x, weight, bias = autocast_inputs("batch_norm", x, weight, bias)
    return BatchNormFunction.apply(
        x, weight, bias, running_mean, running_var, training, momentum, eps, router.layer
    )


def _rms_norm(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .norm_functions import RMSNormFunction

    x = args[0] if args else kwargs.get("input")
    weight = _arg(args, kwargs, 2, "weight", None)
    if not router.compresses_norms or not (_saves(x) or wants_grad(weight)):
        return NotImplemented
    if not plain_float(x):
        return NotImplemented
    shape = list(_arg(args, kwargs, 1, "normalized_shape", None))
    eps = _arg(args, kwargs, 3, "eps", None)
    return note_output(RMSNormFunction.apply(x, shape, weight, eps, router.layer))


def _normalize(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .norm_functions import NormalizeFunction

    x = args[0] if args else kwargs.get("input")
    p = _arg(args, kwargs, 1, "p", 2.0)
    dim = _arg(args, kwargs, 2, "dim", 1)
    eps = _arg(args, kwargs, 3, "eps", 1e-12)
    if _arg(args, kwargs, 4, "out", None) is not None or p != 2 or not _saves(x):
        return NotImplemented
    if router.spec.norm_bits is None or not isinstance(dim, int):
        return NotImplemented
    return NormalizeFunction.apply(x, dim, float(eps), router.layer, NORMALIZED)


# ---- dropout: the keep mask at 1 bit ---------------------------------------------------------


def _dropout(p_index: int, train_index: int, inplace: Callable[[tuple, dict], bool]) -> _Handler:
    def handle(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
        from .masked_functions import DropoutFunction, note_dropout_output

        x = args[0] if args else kwargs.get("input")
        p = _arg(args, kwargs, p_index, "p", 0.5)
        train = kwargs.get("training", kwargs.get("train", True))
        if len(args) > train_index:
            train = args[train_index]
        if not (_saves(x) and train and isinstance(p, (int, float)) and 0 < p < 1):
            return NotImplemented
        return note_dropout_output(
            DropoutFunction.apply(x, float(p), inplace(args, kwargs), router.layer)
        )

    return handle


# ---- attention: the model's own kernel, compressed q, k, v --------------------------------


def _sdpa(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .attention import scaled_dot_product_attention

    if router.spec.conv_bits is None:
        return NotImplemented
    return scaled_dot_product_attention(args, kwargs, router.layer)


def _multi_head(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .multihead import multi_head_attention

    if router.spec.conv_bits is None:
        return NotImplemented
    return multi_head_attention(router.layer, args, kwargs)


# ---- the loss: neither logits nor log-probabilities kept -----------------------------------

_CE_OPTIONS = ("weight", "ignore_index", "reduction", "label_smoothing")


def _cross_entropy(router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    from .loss import CrossEntropyFunction, is_narrow_head_output, linear_source, mark_loss_head

    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
    bound = {n: kwargs[n] for n in (*names, "label_smoothing") if n in kwargs}
    bound.update(zip(names, args, strict=False))
    if set(kwargs) - {*names, "label_smoothing"} or len(args) > len(names):
        return NotImplemented
    x, target = bound.get("input"), bound.get("target")
    if router.spec.conv_bits is None or not _saves(x) or not isinstance(target, Tensor):
        return NotImplemented
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        return NotImplemented
    if x.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        return NotImplemented  # class probabilities, spatial losses: torch's own
    options = {n: bound[n] for n in _CE_OPTIONS if n in bound}
    source = linear_source(x)
    if source is not None:
        mark_loss_head(x)
    exact = source is None and is_narrow_head_output(x)  # its logits kept as they are
    return CrossEntropyFunction.apply(x, target, options, source, router.layer, exact)


def _cast(router: FunctionalRouter, args: tuple, kwargs: dict, func: Any) -> Any:
    from .loss import note_cast

    out = func(*args, **kwargs)
    x = args[0] if args else None
    if (
        isinstance(out, Tensor)
        and isinstance(x, Tensor)
        and out is not x
        and out.shape == x.shape
        and out.requires_grad
    ):
        note_cast(out, x)
    return out


def _table() -> dict[Any, _Handler]:
    T = torch.Tensor
    relu = _masked("relu", _no_param, _never_inplace)
    relu_ = _masked("relu", _no_param, _always_inplace)
    table: dict[Any, _Handler] = {
        F.relu: _masked("relu", _no_param, _inplace_arg(1)),
        torch.relu: relu,
        T.relu: relu,
        torch.relu_: relu_,
        T.relu_: relu_,
        F.relu_: relu_,
        F.relu6: _masked("hardtanh", _relu6_range, _inplace_arg(1)),
        F.hardtanh: _masked("hardtanh", _hardtanh_range, _inplace_arg(3)),
        F.hardtanh_: _masked("hardtanh", _hardtanh_range, _always_inplace),
        F.leaky_relu: _masked("leaky_relu", _slope, _inplace_arg(2)),
        F.leaky_relu_: _masked("leaky_relu", _slope, _always_inplace),
        F.hardsigmoid: _fewbit(FB.hardsigmoid, ("inplace",), smooth=False),
        F.threshold: _fewbit(FB.threshold, ("threshold", "value", "inplace"), smooth=False),
        F.hardshrink: _fewbit(FB.hardshrink, ("lambd",), smooth=False),
        F.softshrink: _fewbit(FB.softshrink, ("lambd",), smooth=False),
        F.gelu: _fewbit(FB.gelu, ("approximate",)),
        F.silu: _fewbit(FB.silu, ("inplace",)),
        F.hardswish: _fewbit(FB.hardswish, ("inplace",)),
        F.mish: _fewbit(FB.mish, ("inplace",)),
        F.elu: _fewbit(FB.elu, ("alpha", "inplace")),
        F.celu: _fewbit(FB.celu, ("alpha", "inplace")),
        F.selu: _fewbit(FB.selu, ("inplace",)),
        F.softplus: _fewbit(FB.softplus, ("beta", "threshold")),
        F.logsigmoid: _fewbit(FB.logsigmoid, ()),
        F.softsign: _fewbit(FB.softsign, ()),
        F.tanhshrink: _fewbit(FB.tanhshrink, ()),
        F.layer_norm: _layer_norm,
        F.group_norm: _group_norm,
        F.batch_norm: _batch_norm,
        F.dropout: _dropout(1, 2, _inplace_arg(3)),
        torch.dropout: _dropout(1, 2, _never_inplace),
        torch.dropout_: _dropout(1, 2, _always_inplace),
    }
    for fn in (torch.sigmoid, T.sigmoid, F.sigmoid):
        table[fn] = _fewbit(FB.sigmoid, ())
    for fn in (torch.tanh, T.tanh, F.tanh):
        table[fn] = _fewbit(FB.tanh, ())
    table[F.normalize] = _normalize
    table[F.cross_entropy] = _cross_entropy
    for cast in (torch.Tensor.float, torch.Tensor.to, torch.Tensor.type_as):
        table[cast] = lambda router, args, kwargs, cast=cast: _cast(router, args, kwargs, cast)
    table[F.scaled_dot_product_attention] = _sdpa
    table[F.multi_head_attention_forward] = _multi_head
    rms_norm = getattr(F, "rms_norm", None)
    if rms_norm is not None:
        table[rms_norm] = _rms_norm
    return table


_TABLE = _table()
_PRODUCTS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})


@torch.compiler.disable
def _run_eagerly(handler: Any, router: FunctionalRouter, args: tuple, kwargs: dict) -> Any:
    """A routed call runs outside Dynamo's trace (a graph break under torch.compile): its
    bookkeeping keys tensors by identity and draws a fresh rounding seed every call, which a
    traced graph would freeze into constants."""
    return handler(router, args, kwargs)


class FunctionalRouter:
    """Routes functional calls (see the module docstring) at one level of the layer route.

    ``fewbit_bits``: derivative bits of smooth activations (None: not routed).
    Called by :class:`actcore.saved_tensors.op_mode.OpMode` as ``router(func, args,
    kwargs)``; returns the routed result or ``NotImplemented`` (the mode then calls
    ``func`` itself).
    """

    def __init__(self, spec: LevelSpec, fewbit_bits: int | None) -> None:
        self.spec = spec
        self.fewbit_bits = fewbit_bits
        self.compresses_norms = spec.norm_bits is not None
        self.layer = FunctionalLayer(spec)

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        try:
            handler = _TABLE.get(func)
        except TypeError:  # an unhashable callable: none of ours
            return NotImplemented
        if handler is None or in_checkpoint():
            # checkpoint drops what is saved in its region and reruns it in backward, where
            # no scope routes: both runs must save the same tensors, so the op stays plain
            return NotImplemented
        return _run_eagerly(handler, self, args, kwargs)

    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """After an unrouted call: what its output derives from, for products (a gated MLP's
        ``act(gate) * up``, a layer scale): a later save of the product refers to the packings
        of its operands instead of keeping a copy (:func:`actcore.layers.stash.derive`)."""
        try:
            product = func in _PRODUCTS
            rows = func in ROW_FUNCS
        except TypeError:
            return
        if rows:
            note_rows(out, func, args, kwargs)
            return
        if (
            product
            and isinstance(out, Tensor)
            and out.requires_grad
            and len(args) == 2
            and not kwargs
            and self.spec.conv_bits is not None
        ):
            # bilinear: affine in each operand when they are two tensors (x * x is not)
            derive_from(out, torch.mul, args, affine=args[0] is not args[1])

    @staticmethod
    def routes(func: Any) -> bool:
        """Whether ``func`` is one of the routed functionals."""
        try:
            return func in _TABLE
        except TypeError:
            return False


class AttentionRouter:
    """The saved-tensor hooks route's router (for :class:`actcore.saved_tensors.op_mode.OpMode`): sdpa and
    ``F.multi_head_attention_forward`` calls run through
    :class:`actcore.layers.attention.AttentionFunction`, which keeps q, k, v (packed by the hooks)
    and reruns the call in backward. A fused kernel's own backward would recompute the
    probabilities as ``exp(q k^T * scale - logsumexp)`` from rounded q and k and an exact
    ``logsumexp``: no longer normalised, and with an outlier feature its gradient
    overflows. Where ``hooks``' policy keeps everything as it is (L0), calls run as they are."""

    def __init__(self, hooks: Any) -> None:
        self.hooks = hooks  # an actcore.saved_tensors.hooks.SavedTensorHooks

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self.hooks.policy.compresses or torch.compiler.is_compiling():
            return NotImplemented
        if in_checkpoint():
            # (checkpoint keeps nothing in its region and reruns it plainly in backward)
            return NotImplemented
        if func is F.scaled_dot_product_attention:
            from .attention import scaled_dot_product_attention

            return scaled_dot_product_attention(args, kwargs, None)
        if func is F.multi_head_attention_forward:
            from .multihead import multi_head_attention

            return multi_head_attention(None, args, kwargs)
        return NotImplemented

    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Nothing to follow after a call (the router protocol's second half)."""
