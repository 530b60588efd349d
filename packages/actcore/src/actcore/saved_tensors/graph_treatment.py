"""How a compiled graph keeps each tensor it saves: :func:`treatment`, read off the fx
graphs that PyTorch hands the inlined pack hook (the saved node, its producer in the forward
graph, its consumers in the backward graph). The rules are listed in
:mod:`actcore.saved_tensors.compiled`'s docstring."""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..compressors.channel_scaled import exact_channels
from ..layers.roles import batch_norm_bits
from ..ops.pool_index import offset_bits

__all__ = [
    "EXACT_FEATURE_SHARE",
    "FLOATS",
    "RECOMPUTED_STATISTICS_BITS",
    "GraphPolicy",
    "KindBits",
    "Treatment",
    "treatment",
]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
EXACT_FEATURE_SHARE = 16
"""q and k of a recomputed attention keep ``head_dim // EXACT_FEATURE_SHARE`` features (at
least one) of largest magnitude exact."""

RECOMPUTED_STATISTICS_BITS = 8
"""The fewest bits of a norm's input from which backward recomputes the norm's statistics
(a fused ``native_layer_norm`` replayed in backward): a variance taken of a 4-bit input holds
the rounding noise's too (a small ViT's gradient cosine 0.80 at 4 bits, 0.99 at 8). A norm
whose statistics backward reads as saved (a decomposed RMS norm's means, which a converted
model's recomputed norms keep exact) takes the level's row-norm bits."""


@dataclass(frozen=True)
class KindBits:
    """Bits of a saved tensor by what the forward does with it, as a level of the layer
    route gives them (None keeps that kind exact): the input of a convolution or matrix
    product, of a batch norm, of a norm over each sample's features (layer, group, RMS), of
    a smooth activation."""

    product: int | None
    batch_norm: int | None
    row_norm: int | None
    activation: int | None


@dataclass(frozen=True)
class GraphPolicy:
    """What a compiled graph's pack needs: the level's bits (None keeps everything), the
    smallest tensor compressed, the group size and whether exact ops keep their tensors.
    ``kinds``: a converted model's bits by kind of input (its level's); ``bits`` then is
    what every other saved tensor gets."""

    bits: int | None
    min_numel: int = 1024
    group_size: int = 256
    exact_ops: bool = True
    nonlinear_bits: int = 4  # the fewest bits of a tensor backward reads nonlinearly
    kinds: KindBits | None = None


def _packets(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


_VIEWS = _packets(
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "alias", "clone", "contiguous", "as_strided",
    "_to_copy", "detach",
)  # fmt: skip
_MATMULS = _packets("mm", "bmm", "addmm", "baddbmm", "convolution_backward", "matmul")
_ATTENTION_BACKWARDS = _packets(
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_efficient_attention_backward",
    "_flash_attention_backward",
)
_ATTENTION_FORWARDS = _packets(
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_efficient_attention_forward",
    "_flash_attention_forward",
)
_EXACT_CONSUMERS = _packets(
    "div", "reciprocal", "log", "log1p", "log2", "pow", "sqrt", "rsqrt", "exp", "exp2",
    "expm1", "eq", "ne", "lt", "le", "gt", "ge", "max", "min", "amax", "amin", "maximum",
    "minimum", "fmax", "fmin", "sort", "topk", "argmax", "argmin", "sign", "sgn",
    "_log_softmax_backward_data", "prod", "cumprod", "atan2", "remainder", "fmod",
)  # fmt: skip
# periodic: an absolute error of the argument, not a relative one, sets the error of the value
# (rotary angles run to hundreds of radians)
_PERIODIC = _packets("sin", "cos", "tan")
_EXACT_PRODUCERS = _packets(
    "_log_softmax", "log_softmax", "mean", "sum", "var_mean", "var", "std", "amax", "amin",
    "rsqrt", "reciprocal", "native_layer_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "native_group_norm",
    "_fused_rms_norm", "logsumexp",
)  # fmt: skip
# what an attention backward reads linearly: v (dP = dO v^T) and the output (D = rowsum(dO o))
_ATTENTION_LINEAR = frozenset({"value", "out"})
_SPLITS = _packets("split", "split_with_sizes", "chunk", "unbind", "tensor_split")
_SOFTMAX_STATISTICS = _packets("amax", "logsumexp")
_PROBABILITIES = _packets("_softmax", "softmax", "_safe_softmax", "sigmoid", "tanh")
_RELUS = _packets("relu", "relu_")
_FILLS = {  # ops that make a tensor of one value: the position of that value's argument
    **dict.fromkeys(_packets("scalar_tensor"), 0),
    **dict.fromkeys(_packets("full", "full_like", "new_full"), 1),
}
_COMPARISONS = _packets("le", "gt", "lt", "ge", "eq", "ne")
_SHAPE_ONLY = {  # backward ops that read the argument at this position for its shape only
    op: 1
    for op in _packets(
        "max_pool2d_with_indices_backward",
        "max_pool3d_with_indices_backward",
        "nll_loss_backward",  # (the log-probabilities: their gradient is zeros but at targets)
        "nll_loss2d_backward",
    )
}
# what the forward does with a tensor, by the op that reads it (KindBits' kinds)
_PRODUCT_INPUTS = _packets(
    "convolution", "_convolution", "mm", "addmm", "bmm", "baddbmm", "matmul", "linear"
)
_BATCH_NORMS = _packets(
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "batch_norm", "cudnn_batch_norm",
)  # fmt: skip
_ROW_NORMS = _packets(
    "native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "_fused_rms_norm",
    "rms_norm",
)  # fmt: skip
_MOMENTS = _packets("var_mean", "var", "std", "std_mean")  # a decomposed norm's statistics
_SMOOTH = _packets(
    "gelu", "silu", "mish", "elu", "selu", "celu", "softplus", "hardswish", "hardsigmoid",
    "log_sigmoid_forward", "erf",
)  # fmt: skip
_REDUCTIONS = _packets(
    "mean", "sum", "var_mean", "var", "std", "std_mean", "amax", "amin", "logsumexp",
    "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "native_group_norm", "_fused_rms_norm",
)  # fmt: skip
_POINTWISE = _packets(
    "add", "sub", "mul", "div", "rsqrt", "sqrt", "reciprocal", "pow", "neg", "clamp", "clamp_min"
)
# forward ops that backward replays only where the partitioner chose to recompute them (with
# ``activation_memory_budget``): a mask or an argmax decided again, or a convolution whose
# output a norm, a mask and the next layers read
_REPLAYED_SELECTIONS = _packets(
    "relu", "relu_", "threshold", "hardtanh", "convolution", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices",
)  # fmt: skip


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _producer(node: Any) -> tuple[Any, int | None]:
    """The op that made ``node``, through views and the pieces of a split (None: an input),
    and for an op with several outputs, which one."""
    while node.op == "call_function":
        op = _packet(node.target)
        if op in _VIEWS and node.args:
            node = node.args[0]
        elif node.target is operator.getitem:
            source = node.args[0]
            source_op = _packet(getattr(source, "target", None))
            if source_op not in _SPLITS:
                return source_op, node.args[1]
            node = source.args[0]
        else:
            return op, None
    return None, None


_CONVERT = getattr(getattr(torch.ops, "prims", None), "convert_element_type", None)


_WEIGHT_ARGUMENT = {  # where a product takes its weight
    **dict.fromkeys(_packets("convolution", "_convolution", "mm", "bmm", "matmul", "linear"), 1),
    **dict.fromkeys(_packets("addmm", "baddbmm"), 2),
}


def _copied_weight(node: Any) -> bool:
    """Whether ``node`` is a cast or view of a graph input (not the input itself) that the
    forward reads as a product's weight: under autocast, a weight's lower-precision copy,
    which the graph saves for backward (the layer route keeps weights exact). A parameter
    is a graph input (not packed); a copy made inside the graph is not, and was."""
    chain = []
    source = node
    while source.op == "call_function" and source.args:
        op = _packet(source.target)
        if not isinstance(source.args[0], torch.fx.Node) or (
            op not in _VIEWS and (_CONVERT is None or op is not _CONVERT)
        ):
            return False
        chain.append(source)
        source = source.args[0]
    if not chain or source.op != "placeholder":
        return False
    # (what is saved may be a view made for backward alone: the copy's other uses tell)
    return any(_WEIGHT_ARGUMENT.get(op) == pos for op, _, pos, _ in _uses(chain[-1:]))


def _numel(node: Any) -> Any:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.numel() if isinstance(val, Tensor) else None


def _search(node: Any, visit: Any, depth: int = 8) -> Any:
    """Walk back from ``node`` through at most ``depth`` call nodes: ``visit(current)`` gives
    ``(found, nodes to follow)``; the first ``found`` that is not None, else None."""
    todo, seen = [node], set()
    while todo and depth:
        depth -= 1
        current = todo.pop()
        if current in seen or current.op != "call_function":
            continue
        seen.add(current)
        found, more = visit(current)
        if found is not None:
            return found
        todo.extend(more)
    return None


def _reduction(node: Any) -> Any:
    """The reduction ``node`` is a statistic of, or None: made from it by ops that keep its
    size (a norm's ``rsqrt(var + eps) / n`` after inductor's decompositions), not a tensor
    that merely used one (``(x - mean) * rstd`` has the size of ``x``, which is followed)."""
    numel = _numel(node)
    if numel is None:
        return None

    def visit(current: Any) -> tuple[Any, list[Any]]:
        op = _packet(current.target)
        if current.target is operator.getitem:
            index, current = current.args[1], current.args[0]
            op = _packet(getattr(current, "target", None))
            if index == 0 and (op in _BATCH_NORMS or op in _ROW_NORMS):
                return None, []  # a norm's output, not its statistics
        if op in _REDUCTIONS:
            return current, []
        if op not in _VIEWS and op not in _POINTWISE:
            return None, []
        args = [a for a in current.args if isinstance(a, torch.fx.Node)]
        return None, [a for a in args if op in _VIEWS or _numel(a) == numel]

    return _search(node, visit)


def _norm_of(reduction: Any) -> str | None:
    """Which norm the statistic ``reduction`` belongs to (``"batch_norm"``, ``"row_norm"``)."""
    op = _packet(reduction.target)
    if op in _BATCH_NORMS:
        return "batch_norm"
    if op in _ROW_NORMS:
        return "row_norm"
    if op in _MOMENTS:
        return _moment_kind(reduction)
    source = reduction.args[0] if reduction.args else None
    squared = isinstance(source, torch.fx.Node) and _square(source)
    return "row_norm" if op is torch.ops.aten.mean and squared else None  # an RMS norm's


def _normalized(node: Any) -> str | None:
    """Which norm's output ``node`` is (through its affine map and views), or None: a
    normalization op's first output, or a tensor of ``node``'s size scaled or shifted by a
    norm's statistic."""
    numel = _numel(node)

    def visit(current: Any) -> tuple[str | None, list[Any]]:
        if current.target is operator.getitem:
            source_op = _packet(getattr(current.args[0], "target", None))
            if current.args[1] != 0:
                return None, []
            if source_op in _BATCH_NORMS:
                return "batch_norm", []
            return ("row_norm" if source_op in _ROW_NORMS else None), []
        op = _packet(current.target)
        if op in _VIEWS and current.args:
            return None, [current.args[0]]
        if op not in _POINTWISE:
            return None, []
        follow = []
        for arg in current.args:
            if not isinstance(arg, torch.fx.Node):
                continue
            if _numel(arg) == numel:
                follow.append(arg)
                continue
            reduction = _reduction(arg)
            norm = _norm_of(reduction) if reduction is not None else None
            if norm is not None:
                return norm, []
        return None, follow

    return _search(node, visit)


def _moment_kind(user: Any) -> str | None:
    """A decomposed norm by the dimensions of its ``var_mean``: over the batch dimension a
    batch norm, over each sample's features a row norm."""
    dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    source = user.args[0] if user.args else None
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    ndim = val.dim() if isinstance(val, Tensor) else 0
    if dims is None:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    return "batch_norm" if any(d % max(ndim, 1) == 0 for d in dims) else "row_norm"


def _square(node: Any) -> bool:
    """Whether ``node`` is ``x ** 2``."""
    return _packet(node.target) is torch.ops.aten.pow and node.args[1:2] == (2,)


def _mean_of_square(user: Any) -> bool:
    """Whether ``user`` squares its input for a mean (``mean(x ** 2)``: an RMS norm)."""
    return _square(user) and any(_packet(u.target) is torch.ops.aten.mean for u in user.users)


def _reached(starts: list[Any], found: Any, depth: int = 4) -> bool:
    """Whether ``found(op, user)`` holds for a use of the backward graph's nodes ``starts``
    or of a value elementwise ops make from them (within ``depth`` ops)."""
    nodes = list(starts)
    for _ in range(depth):
        uses = _uses(nodes)
        if any(found(op, user) for op, user, *_ in uses):
            return True
        nodes = [user for op, user, *_ in uses if op in _POINTWISE]
    return False


def _replays_a_selection(starts: list[Any], depth: int = 4) -> bool:
    """Whether backward replays a ReLU's mask, a max pool's argmax or a convolution from the
    nodes ``starts`` (directly, or through elementwise ops and norms it replays too)."""
    nodes = list(starts)
    for _ in range(depth):
        uses = _uses(nodes)
        if any(op in _REPLAYED_SELECTIONS for op, *_ in uses):
            return True
        nodes = [
            user
            for op, user, *_ in uses
            if op in _POINTWISE or op in _BATCH_NORMS or op in _ROW_NORMS or op is operator.getitem
        ]
    return False


def _takes_statistics(op: Any, user: Any) -> bool:
    """Whether ``user`` takes a norm's statistics of its input: a fused norm replayed, a
    ``var_mean``, a mean of a square."""
    return op in _ROW_NORMS or op in _MOMENTS or _mean_of_square(user)


def _forward_kinds(node: Any) -> set[str]:
    """What the forward does with ``node``: the kinds of :class:`KindBits` it is an input of."""
    kinds: set[str] = set()
    for op, user, pos, _ in _uses([node]):
        if op in _PRODUCT_INPUTS:
            if not (pos == 0 and op in (torch.ops.aten.addmm, torch.ops.aten.baddbmm)):
                kinds.add("product")  # (addmm's first argument is its bias)
        elif op in _BATCH_NORMS:
            kinds.add("batch_norm")
        elif op in _ROW_NORMS:
            kinds.add("row_norm")
        elif op in _SMOOTH:
            kinds.add("activation")
        elif op in _MOMENTS:
            kind = _moment_kind(user)
            kinds.update([kind] if kind else [])
        elif _mean_of_square(user):
            kinds.add("row_norm")  # an RMS norm, decomposed
    return kinds


_SPATIAL = _packets(
    "convolution", "_convolution", "max_pool2d_with_indices", "max_pool3d_with_indices",
    "avg_pool2d", "avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d",
    "adaptive_avg_pool2d", "upsample_nearest2d", "upsample_bilinear2d",
)  # fmt: skip


def _channel_dim(node: Any, ndim: int) -> int:
    """The dim of the channels of ``node`` (an ``ndim``-D tensor): 1 where the forward reads
    it as ``[N, C, *spatial]`` (a convolution, a batch norm, a pool), else the last."""
    if ndim < 3:
        return -1
    for op, user, _, _ in _uses([node]):
        if op in _SPATIAL or op in _BATCH_NORMS:
            return 1
        if op in _MOMENTS and _moment_kind(user) == "batch_norm":
            return 1
    return -1


_MAX_POOLS = {
    op: nd
    for nd, names in ((1, ("max_pool1d_with_indices",)), (2, ("max_pool2d_with_indices",)),
                      (3, ("max_pool3d_with_indices",)))
    for op in _packets(*names)
}  # fmt: skip


def _unviewed(node: Any) -> Any:
    """The node ``node`` is a view of (through :data:`_VIEWS`), or ``node``."""
    while node.op == "call_function" and _packet(node.target) in _VIEWS and node.args:
        node = node.args[0]
    return node


def _pooling_indices(node: Any) -> tuple[Any, ...] | None:
    """``(pool node, its input's spatial sizes)`` if ``node`` is (a view of) the indices of a
    max pool (or the offsets of inductor's low-memory one) whose input's spatial sizes are
    known ints, else None."""
    node = _unviewed(node)
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 1:
        return None
    pool = node.args[0]
    nd = _MAX_POOLS.get(_packet(getattr(pool, "target", None)))
    if _offsets_pool(pool) and len(pool.args) > 1:  # (inductor's: offsets already)
        nd = len(pool.args[1]) if isinstance(pool.args[1], (list, tuple)) else None
    val = pool.args[0].meta.get("val") if nd and pool.args else None
    if not isinstance(val, Tensor) or not all(isinstance(n, int) for n in val.shape[-nd:]):
        return None
    return pool, tuple(val.shape[-nd:])


def _offsets_pool(pool: Any) -> bool:
    """Whether ``pool`` is inductor's low-memory max pool, whose second output is each
    output's argmax as its offset inside the window (int8) rather than a flat index."""
    return "_low_memory_max_pool_with_offsets" in str(getattr(pool, "target", ""))


def _pooling_index_dtype(node: Any) -> torch.dtype | None:
    """The narrowest integer type that holds the max-pooling indices ``node`` exactly (they
    index one plane of the pooled input), or None if ``node`` is not such indices or the
    plane's size is symbolic."""
    found = _pooling_indices(node)
    if found is None or _offsets_pool(found[0]):
        return None
    plane = math.prod(found[1])
    if plane <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32 if plane <= torch.iinfo(torch.int32).max else None


def _pooling_window(node: Any) -> tuple[tuple[int, ...], ...] | None:
    """``(input's spatial sizes, kernel, stride, padding, dilation)`` of the max pool whose
    indices ``node`` is itself (not a view of them), from the pool's arguments (aten's
    defaults: the stride is the kernel, no padding, no dilation); None otherwise or where an
    argument is not known ints."""
    found = _pooling_indices(node)
    if found is None or _unviewed(node) is not node:
        return None
    pool, spatial = found
    nd = len(spatial)
    args = list(pool.args[1:5]) + [None] * (5 - len(pool.args))
    names = ("kernel_size", "stride", "padding", "dilation")
    kernel, stride, padding, dilation = (
        pool.kwargs.get(name, arg) for name, arg in zip(names, args, strict=False)
    )

    def spread(value: Any, default: Any) -> tuple[int, ...] | None:
        value = (
            default if value is None or (isinstance(value, (list, tuple)) and not value) else value
        )
        value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        value = value * nd if len(value) == 1 else value
        return value if len(value) == nd and all(isinstance(v, int) for v in value) else None

    window = (spread(kernel, None), spread(stride, kernel), spread(padding, 0), spread(dilation, 1))
    if any(w is None for w in window):
        return None
    return (spatial, *window)


def _mask_test(op: Any, user: Any, pos: int) -> bool:
    """Whether ``user`` reads a ReLU's output only as ``output > 0`` (a comparison with a
    constant, or ``threshold_backward(grad, output, 0)``)."""
    if op is torch.ops.aten.threshold_backward:
        return pos == 1 and user.args[2] == 0
    return (
        op in _COMPARISONS
        and pos in (0, 1)
        and len(user.args) == 2
        and not isinstance(user.args[1 - pos], torch.fx.Node)
    )


def _as_element(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to an element of ``dtype`` (to nearest, ties to even), in plain Python:
    this runs while a pack hook is traced, where a tensor made here would become a constant of
    the graph."""
    if dtype == torch.float64:
        return float(value)
    if dtype == torch.float16:
        try:
            return struct.unpack("<e", struct.pack("<e", value))[0]
        except OverflowError:
            return math.copysign(math.inf, value)
    try:
        single = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        single = math.copysign(math.inf, value)
    if dtype != torch.bfloat16 or not math.isfinite(single):
        return single
    (word,) = struct.unpack("<I", struct.pack("<f", single))
    word = (word + 0x7FFF + ((word >> 16) & 1)) & 0xFFFF0000  # (to nearest even, in bfloat16)
    return struct.unpack("<f", struct.pack("<I", word))[0]


def _constant(arg: Any, dtype: torch.dtype) -> float | None:
    """The value of ``arg`` as an element of ``dtype`` when it is a constant scalar (a Python
    number, a ``scalar_tensor`` or ``full``, views of one), else None; None for NaN (it
    equals nothing)."""
    own = dtype
    if isinstance(arg, torch.fx.Node):
        arg = _unviewed(arg)
        position = _FILLS.get(_packet(arg.target)) if arg.op == "call_function" else None
        if position is None or len(arg.args) <= position:
            return None
        val = arg.meta.get("val")
        own = val.dtype if isinstance(val, Tensor) and val.dtype in FLOATS else dtype
        arg = arg.args[position]  # (the fill value)
    if isinstance(arg, bool) or not isinstance(arg, (int, float)):
        return None
    value = _as_element(_as_element(float(arg), own), dtype)
    return None if math.isnan(value) else value


def _two_constants(node: Any, dtype: torch.dtype) -> tuple[float, float] | None:
    """``(a, b)`` when ``node`` is ``where(condition, a, b)`` of two constant scalars (through
    views), as elements of ``dtype``: a float mask such as the causal mask an attention reads
    (0 where attended, -inf elsewhere), which one bit an element holds exactly."""
    node = _unviewed(node)
    if node.op != "call_function" or _packet(node.target) is not torch.ops.aten.where:
        return None
    if len(node.args) != 3:
        return None
    a, b = _constant(node.args[1], dtype), _constant(node.args[2], dtype)
    return None if a is None or b is None else (a, b)


def _read_through_exp(starts: list[Any]) -> bool:
    """Whether the backward graph reads its input ``starts`` (:func:`_placeholders`) only
    through ``exp`` of it, less values that do not depend on it (``exp(x - max - log(sum))``:
    a log-softmax recomputed from its saved logits), or as the output a log-softmax's
    backward exponentiates."""
    return bool(starts) and _only_exponentiated(starts, starts[0], 4)


def _only_exponentiated(nodes: list[Any], source: Any, depth: int) -> bool:
    uses = [use for use in _uses(nodes) if _SHAPE_ONLY.get(use[0]) != use[2]]
    if not uses or depth == 0:
        return False
    for op, user, pos, _ in uses:
        if (op is torch.ops.aten.exp and pos == 0) or (
            op is torch.ops.aten._log_softmax_backward_data and pos == 1
        ):
            continue
        shifted = (op is torch.ops.aten.sub and pos == 0) or (
            op is torch.ops.aten.add and pos in (0, 1)
        )
        if not shifted or len(user.args) != 2 or _depends_on(user.args[1 - pos], source):
            return False
        if not _only_exponentiated([user], source, depth - 1):
            return False
    return True


def _depends_on(arg: Any, source: Any, depth: int = 16) -> bool:
    """Whether the fx value ``arg`` may be computed from ``source`` (True past ``depth``)."""
    todo, seen = [(arg, 0)], set()
    while todo:
        node, d = todo.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        if node is source or d > depth:
            return True
        seen.add(node)
        todo.extend((a, d + 1) for a in node.all_input_nodes)
    return False


def _softmax_input(node: Any) -> bool:
    """Whether the forward takes a max or logsumexp of ``node`` (through views): a softmax's
    input, which backward exponentiates against that statistic."""
    return any(op in _SOFTMAX_STATISTICS for op, *_ in _uses([node]))


def _argument_name(user: Any, pos: int, node: Any = None) -> str | None:
    """The schema name of ``user``'s argument at ``pos``, or of the keyword argument that
    is ``node`` (``pos == -1``)."""
    if pos < 0:
        return next((k for k, v in user.kwargs.items() if v is node), None)
    schema = getattr(user.target, "_schema", None)
    if schema is None or not 0 <= pos < len(schema.arguments):
        return None
    return schema.arguments[pos].name


def _linear_use(op: Any, user: Any, pos: int) -> bool:
    """Whether ``user`` reads its argument ``pos`` linearly though its op can be nonlinear:
    a numerator (``x / d``), or a power 1 or 2 (``x ** 2``'s backward reads ``x ** 1``:
    an RMS norm's backward)."""
    if op is torch.ops.aten.div and pos == 0:
        return True
    return op is torch.ops.aten.pow and pos == 0 and len(user.args) > 1 and user.args[1] in (1, 2)


def _recomputed_logsumexp(user: Any) -> bool:
    """Whether the attention backward ``user`` takes a logsumexp that the backward graph
    recomputed (from the same packed q and k), not one saved from the forward."""
    schema = getattr(user.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "logsumexp" not in names:
        return False
    index = names.index("logsumexp")
    lse = user.args[index] if index < len(user.args) else user.kwargs.get("logsumexp")
    return isinstance(lse, torch.fx.Node) and lse.op != "placeholder"


def _uses(starts: list[Any]) -> list[tuple[Any, Any, int, Any]]:
    """``(op, user, argument position or -1 for a keyword, the node it reads)`` of every
    non-view use of the nodes ``starts``, through views."""
    found: list[tuple[Any, Any, int, Any]] = []
    todo = list(starts)
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            op = _packet(user.target) if user.op == "call_function" else None
            if op in _VIEWS:
                todo.append(user)
                continue
            pos = next((i for i, a in enumerate(user.args) if a is node), -1)
            found.append((op, user, pos, node))
    return found


def _placeholders(bw_graph: Any, name: str) -> list[Any]:
    """The backward graph's input ``name`` (a saved tensor), as a list of at most one node."""
    return [n for n in bw_graph.find_nodes(op="placeholder") if n.name == name]


@dataclass(frozen=True)
class Treatment:
    """How one saved tensor is kept: ``kind`` is ``"keep"``, ``"quantize"``, ``"relu"``
    (mask plus values), ``"mask"`` (a ReLU's output of which backward reads only where it
    is positive: its 1-bit mask alone), ``"offset"`` (a max pool's indices as offsets inside
    their windows, ``bits`` each, the pool's geometry in ``window``) or ``"index"``
    (max-pooling indices seen through a view, in the narrowest integer type that holds
    them), ``"bits"`` (a bool tensor at 1 bit an element), ``"select"`` (a float tensor
    that holds one of two constants, chosen by a bool: a float attention mask, 1 bit an
    element, lossless) or ``"exp"`` (a tensor backward reads only
    through ``exp``, such as log-probabilities or logits: ``exp(x - rowmax)`` quantized, an
    unbiased estimate of what backward reads, and the row maxima exact); ``bits`` the
    quantization's bits; ``why`` names the rule; ``exact_features``: how many features of
    the last dim (those of largest magnitude) are kept exact beside the quantized rest;
    ``channel_dim``: the dim whose channels a quantized tensor is scaled by (each to its own
    range, where its quantization groups would mix channels): dim 1 of what convolutions,
    batch norms and pools read, else the last; ``normalized``: a batch norm's input, packed
    as its channels normalized by their mean and spread over the batch (what the level's
    bits for it assume, :func:`~actcore.layers.roles.batch_norm_bits`; the layer route keeps
    the normalized input too)."""

    kind: str
    bits: int | None = None
    why: str = ""
    exact_features: int = 0
    channel_dim: int = -1  # the dim of its channels (1: a convolution's [N, C, *spatial])
    dtype: torch.dtype | None = None  # what an "index" is stored as; an "offset"'s own
    values: tuple[float, float] | None = None  # a "select"'s two values (where set, where not)
    normalized: bool = False
    window: tuple[tuple[int, ...], ...] | None = None  # an "offset"'s pooling geometry


def _pooling_offsets(x: Tensor, context: dict[str, Any] | None) -> Treatment | None:
    """A max pool's saved argmax as offsets inside its windows at the window's bits: its flat
    indices (int64, converted when packed) or inductor's int8 offsets (packed as they are,
    where the window takes fewer than their 8 bits); None for anything else."""
    already = x.dtype in (torch.int8, torch.uint8)
    if context is None or not (already or x.dtype == torch.int64):
        return None
    window = _pooling_window(context["_node"])
    bits = offset_bits(window[1]) if window is not None else None
    if bits is None or bits > 8 or (already and bits == 8):
        return None
    return Treatment(
        "offset",
        bits,
        why="max-pooling indices, as offsets inside their windows",
        window=window,
        dtype=x.dtype if already else None,  # (already offsets: restored as they are)
    )


def treatment(x: Tensor, policy: GraphPolicy, context: dict[str, Any] | None) -> Treatment:
    """How a compiled graph keeps the saved tensor ``x`` (see the module docstring)."""
    if policy.bits is None:
        return Treatment("keep", why="the level keeps everything")
    if x.dtype == torch.bool and x.layout == torch.strided and x.numel() >= policy.min_numel:
        return Treatment("bits", why="a bool tensor: 1 bit an element")
    if x.dtype not in FLOATS or x.layout != torch.strided:
        offsets = _pooling_offsets(x, context)
        if offsets is not None:
            return offsets
        if x.dtype == torch.int64 and context is not None:
            narrow = _pooling_index_dtype(context["_node"])
            if narrow is not None:
                return Treatment(
                    "index", why=f"max-pooling indices, exact as {narrow}", dtype=narrow
                )
        return Treatment("keep", why="not a float tensor")
    if x.numel() < policy.min_numel:
        return Treatment("keep", why="below min_numel")
    if context is None:
        return Treatment(
            "quantize", max(policy.bits, policy.nonlinear_bits), why="no graph context"
        )
    node = context["_node"]
    if _copied_weight(node):
        return Treatment("keep", why="a weight's copy (a cast or view of a graph input)")
    values = _two_constants(node, x.dtype)
    if values is not None:
        return Treatment("select", why="one of two constants chosen by a bool", values=values)
    starts = _placeholders(context["_bw_graph"], node.name)  # (the saved tensor in backward)
    if _read_through_exp(starts):
        bits = max(policy.bits, policy.nonlinear_bits)
        return Treatment("exp", bits, why="read through exp in backward")
    producer, index = _producer(node)
    normalized = (producer in _BATCH_NORMS or producer in _ROW_NORMS) and index == 0
    if producer in _EXACT_PRODUCERS and not normalized:
        return Treatment("keep", why=f"made by {producer}")
    if producer in _ATTENTION_FORWARDS and index != 0:
        return Treatment("keep", why=f"made by {producer}")
    if _reduction(node) is not None:
        return Treatment("keep", why="a statistic (made from a reduction)")
    if _softmax_input(node):
        return Treatment("keep", why="a softmax's input (logits)")
    if policy.exact_ops and _reached(starts, lambda op, _: op in _PERIODIC):
        return Treatment("keep", why="read through sin or cos in backward")
    if _replays_a_selection(starts):
        # the partitioner recomputes from it (activation_memory_budget): a mask, an argmax or
        # a convolution decided again from a rounded copy would differ from the forward's
        return Treatment("keep", why="backward replays a mask, an argmax or a convolution")
    consumers = _uses(starts)
    relu = producer in _RELUS
    linear = True
    values_read = False  # whether backward reads the values (not only a ReLU's mask, a shape)
    query_or_key = False
    for op, user, pos, read in consumers:
        if _SHAPE_ONLY.get(op) == pos or (relu and _mask_test(op, user, pos)):
            continue  # the ReLU's own mask test: answered by the kept mask
        values_read = True
        if op in _ATTENTION_BACKWARDS or op in _ATTENTION_FORWARDS:
            name = _argument_name(user, pos, read)
            if name in _ATTENTION_LINEAR:
                continue
            if name not in ("query", "key"):  # a mask or bias (-inf where masked), ...
                return Treatment("keep", why=f"an attention's {name}")
            if op in _ATTENTION_BACKWARDS and not _recomputed_logsumexp(user):
                # q and k: the kernel rebuilds the probabilities as exp(q k^T - logsumexp),
                # against a logsumexp of the exact q and k
                return Treatment("keep", why="q or k of an attention backward")
            query_or_key = True
            continue
        if op in _MATMULS or _linear_use(op, user, pos):
            continue
        if policy.exact_ops and op in _EXACT_CONSUMERS:
            return Treatment("keep", why=f"read by {op} in backward")
        linear = False
    if query_or_key:
        # its backward recomputes the attention from the packed q, k, v; the head features of
        # largest magnitude stay exact (an outlier feature's rounding error, multiplied by
        # the other's outlier, would swamp the logits)
        bits = max(policy.bits, policy.nonlinear_bits)
        features = max(1, x.shape[-1] // EXACT_FEATURE_SHARE) if x.dim() else 0
        return Treatment(
            "quantize", bits, why="q or k of a recomputed attention", exact_features=features
        )
    if relu and not values_read:
        return Treatment("mask", why="a ReLU's output read for its mask only")
    kind = "relu" if relu else "quantize"
    # backward takes a norm's statistics of it: more bits (RECOMPUTED_STATISTICS_BITS)
    statistics = _reached(starts, _takes_statistics)
    floor = RECOMPUTED_STATISTICS_BITS if statistics else 1
    channels = _channel_dim(node, x.dim())
    if policy.kinds is not None:
        inputs = _forward_kinds(node)
        if "product" in inputs:
            # a norm's output read by products: kept as the eager route keeps a norm's input,
            # from which it derives the output (pre-norm transformers' q/k/v input)
            norm = _normalized(node)
            inputs |= {norm} if norm is not None else set()
        if inputs:
            chosen = [getattr(policy.kinds, k) for k in sorted(inputs)]
            if any(b is None for b in chosen):
                return Treatment("keep", why=f"the level keeps {'/'.join(sorted(inputs))} inputs")
            bits = max(floor, *(b for b in chosen if b is not None))
            if "batch_norm" in inputs and all(isinstance(n, int) for n in x.shape):
                bits = max(bits, batch_norm_bits(x))  # (few values per channel: more bits)
            if producer in _PROBABILITIES:
                bits = max(bits, policy.nonlinear_bits)
            # a norm's backward is nonlinear in its input: an outlier feature's rounding
            # error would bias it, so the largest features stay exact (as on the layer route)
            exact = exact_channels(x.shape[-1]) if "row_norm" in inputs and x.dim() > 1 else 0
            if kind == "relu":
                exact = 0
            why = f"a {'/'.join(sorted(inputs))} input"
            normalized = kind == "quantize" and inputs == {"batch_norm"} and x.dim() >= 2
            return Treatment(
                kind,
                bits,
                why=why,
                exact_features=exact,
                channel_dim=channels,
                normalized=normalized,
            )
    if linear and producer not in _PROBABILITIES:
        return Treatment(kind, policy.bits, why="read by products only", channel_dim=channels)
    bits = max(policy.bits, policy.nonlinear_bits, floor)
    why = "a norm's statistics recomputed from it" if statistics else "read nonlinearly"
    return Treatment(kind, bits, why=why, channel_dim=channels)
