"""How a compiled graph keeps each tensor it saves: :func:`treatment`, read off the fx
graphs that PyTorch hands the inlined pack hook (the saved node, its producer in the forward
graph, its consumers in the backward graph). The rules are listed in
:mod:`actcore.saved_tensors.compiled`'s docstring."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["EXACT_FEATURE_SHARE", "FLOATS", "GraphPolicy", "Treatment", "treatment"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
EXACT_FEATURE_SHARE = 16
"""q and k of a recomputed attention keep ``head_dim // EXACT_FEATURE_SHARE`` features (at
least one) of largest magnitude exact."""


@dataclass(frozen=True)
class GraphPolicy:
    """What a compiled graph's pack needs: the level's bits (None keeps everything), the
    smallest tensor compressed, the group size and whether exact ops keep their tensors."""

    bits: int | None
    min_numel: int = 1024
    group_size: int = 256
    exact_ops: bool = True
    nonlinear_bits: int = 4  # the fewest bits of a tensor backward reads nonlinearly


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
_COMPARISONS = _packets("le", "gt", "lt", "ge", "eq", "ne")


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


def _consumers(bw_graph: Any, name: str) -> list[tuple[Any, Any, int, Any]]:
    """:func:`_uses` of the backward graph's input ``name``."""
    return _uses([n for n in bw_graph.find_nodes(op="placeholder") if n.name == name])


@dataclass(frozen=True)
class Treatment:
    """How one saved tensor is kept: ``kind`` is ``"keep"``, ``"quantize"`` or ``"relu"``
    (mask plus values); ``bits`` the quantization's bits; ``why`` names the rule;
    ``exact_features``: how many features of the last dim (those of largest magnitude) are
    kept exact beside the quantized rest."""

    kind: str
    bits: int | None = None
    why: str = ""
    exact_features: int = 0


def treatment(x: Tensor, policy: GraphPolicy, context: dict[str, Any] | None) -> Treatment:
    """How a compiled graph keeps the saved tensor ``x`` (see the module docstring)."""
    if policy.bits is None:
        return Treatment("keep", why="the level keeps everything")
    if x.dtype not in FLOATS or x.layout != torch.strided:
        return Treatment("keep", why="not a float tensor")
    if x.numel() < policy.min_numel:
        return Treatment("keep", why="below min_numel")
    if context is None:
        return Treatment(
            "quantize", max(policy.bits, policy.nonlinear_bits), why="no graph context"
        )
    node = context["_node"]
    producer, index = _producer(node)
    if producer in _EXACT_PRODUCERS or (producer in _ATTENTION_FORWARDS and index != 0):
        return Treatment("keep", why=f"made by {producer}")
    if _softmax_input(node):
        return Treatment("keep", why="a softmax's input (logits)")
    consumers = _consumers(context["_bw_graph"], node.name)
    relu = producer in _RELUS
    linear = True
    query_or_key = False
    for op, user, pos, read in consumers:
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
        if (
            relu
            and op in _COMPARISONS
            and pos in (0, 1)
            and len(user.args) == 2
            and not isinstance(user.args[1 - pos], torch.fx.Node)
        ):
            continue  # the ReLU's own mask test: answered by the kept mask
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
    kind = "relu" if relu else "quantize"
    if linear and producer not in _PROBABILITIES:
        return Treatment(kind, policy.bits, why="read by products only")
    return Treatment(kind, max(policy.bits, policy.nonlinear_bits), why="read nonlinearly")
