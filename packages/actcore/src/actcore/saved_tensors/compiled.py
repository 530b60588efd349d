"""The hooks route inside ``torch.compile``: pack and unpack inlined into the compiled graphs.

PyTorch inlines saved-tensor hooks that are fx graphs into the graphs it compiles: the pack
graph into the forward graph's epilogue, once per saved intermediate, and the unpack graph
into the backward graph's prologue (``torch._functorch``'s saved-tensor-hook inlining; the
compiled runtime then saves the packed tensors with the hooks off). Inductor fuses the
quantization with the op that produced the tensor and the dequantization with the one that
consumes it (C++ on CPU, Triton on CUDA), and nothing breaks the graph.

:class:`~actcore.saved_tensors.hooks.SavedTensorHooks` therefore pushes a pair of
:class:`SavedHooksGraph` (one pair per :class:`GraphPolicy`, cached: PyTorch guards a compiled
graph on the hooks' identity, so a new pair would recompile). Called eagerly, outside a
compiled graph, they hand each tensor to the active ``SavedTensorHooks``' own pack and unpack
(the eager route, unchanged). Traced into a compiled graph, they see the saved node, its
producer and its consumers in the backward graph, and treat it by kind (:func:`treatment`):

* kept as it is: non-float tensors, fewer than ``min_numel`` elements, a softmax's input
  (logits: backward exponentiates them against their max), reductions and normalization
  statistics, an attention's logsumexp, q and k of an attention backward that reads a
  saved logsumexp (its kernel rebuilds the probabilities as ``exp(q k^T - logsumexp)``),
  and (with ``exact_ops``) anything a comparison, division, power, log or exp in backward
  reads;
* q and k of an attention that backward recomputes (``F.scaled_dot_product_attention``
  under the hooks, see :class:`~actcore.saved_tensors.op_mode.OpMode`): at least
  ``nonlinear_bits``, their features of largest magnitude exact;
* a ReLU output: its 1-bit nonzero mask plus its values at the level's bits (the mask makes
  the ReLU's backward exact);
* read only by matrix products and convolution backward (and as an attention's v or
  output, which its backward reads linearly): the level's bits;
* otherwise (a smooth activation's input, a softmax / sigmoid / tanh output, a norm's input):
  at least ``nonlinear_bits`` (the hooks route's
  :data:`~actcore.saved_tensors.hooks.ACTIVATION_BITS`).

The quantization is stochastic rounding over groups of ``group_size`` elements, its noise
the native kernels' counter hash under a seed drawn when the graph runs (the
``actcore::rounding_noise`` operator: fresh every call, no seed in the graph, no
recompilation per step, torch's generators untouched); codes are stored in 1-, 2-, 4- or
8-bit slots (3 bits in 4).
Forward outputs are those of the compiled plain graph: only what is saved changes.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..ops.seeds import rounding_noise

__all__ = ["GraphPolicy", "SavedHooksGraph", "graph_hooks", "inlining_supported", "treatment"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
EXACT_FEATURE_SHARE = 16
"""q and k of a recomputed attention keep ``head_dim // EXACT_FEATURE_SHARE`` features (at
least one) of largest magnitude exact."""


def _context_reader() -> Any:
    try:
        from torch._functorch._aot_autograd import graph_compile
    except ImportError:  # pragma: no cover - a torch without AOT autograd's graph_compile
        return None
    if not hasattr(graph_compile, "maybe_inline_graph_saved_tensors_hooks"):
        return None  # pragma: no cover - torch older than the inlining
    return getattr(graph_compile, "_get_saved_tensor_hook_context", None)


_CONTEXT = _context_reader()


def inlining_supported() -> bool:
    """Whether this torch inlines fx-graph saved-tensor hooks into compiled graphs (and says
    which node a hook packs). Without it, compiled graphs' saved tensors go through the eager
    hooks when the compiled code saves them."""
    return _CONTEXT is not None


@dataclass(frozen=True)
class GraphPolicy:
    """What a compiled graph's pack needs: the level's bits (None keeps everything), the
    smallest tensor compressed, the group size and whether exact ops keep their tensors."""

    bits: int | None
    min_numel: int = 1024
    group_size: int = 256
    exact_ops: bool = True
    nonlinear_bits: int = 4  # the fewest bits of a tensor backward reads nonlinearly


class SavedHooksGraph(torch.fx.GraphModule):
    """A one-node fx graph calling an actcore pack or unpack function: what PyTorch inlines
    into compiled graphs, and an ordinary hook when called eagerly."""


# ------------------------------------------------------------------------------ the eager half
_LOCAL = threading.local()  # .owners: the SavedTensorHooks pushed on this thread, innermost last


def _owners() -> list[Any]:
    owners = getattr(_LOCAL, "owners", None)
    if owners is None:
        owners = _LOCAL.owners = []
    return owners


@dataclass
class _Eager:
    """What an eager pack returns: the hooks that packed and their handle."""

    owner: Any
    handle: Any


_FILTERING = {"pushed": 0, "saved": "donated"}  # across threads: pushes active, mode replaced
_FILTERING_LOCK = threading.Lock()


def push_owner(hooks: Any) -> None:
    """Make ``hooks`` the one eager saves go to, and have compiled graphs pack what they save
    from their inputs too (the filtering mode ``"no_static"``: all but parameters and
    buffers). By default PyTorch packs only a graph's intermediates, so an activation that
    crosses a graph break (an input of the next graph) would be kept whole."""
    import torch._functorch.config as functorch_config

    _owners().append(hooks)
    with _FILTERING_LOCK:
        if not _FILTERING["pushed"]:
            _FILTERING["saved"] = functorch_config.saved_tensors_hooks_filtering_mode
            functorch_config.saved_tensors_hooks_filtering_mode = "no_static"
        _FILTERING["pushed"] += 1


def pop_owner(hooks: Any) -> None:
    import torch._functorch.config as functorch_config

    owners = _owners()
    for i in range(len(owners) - 1, -1, -1):
        if owners[i] is hooks:
            del owners[i]
            with _FILTERING_LOCK:
                _FILTERING["pushed"] -= 1
                if not _FILTERING["pushed"]:
                    functorch_config.saved_tensors_hooks_filtering_mode = _FILTERING["saved"]
            return


# ---------------------------------------------------------------------------- classification
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


# ------------------------------------------------------------------------------ quantization
def _noise(shape: list[int], anchor: Tensor) -> Tensor:
    """Uniform [0, 1) noise (``actcore::rounding_noise``: the native kernels' counter hash
    under a seed drawn when the graph runs: fresh every call, no seed in the graph, torch's
    generators untouched). An opaque op: the integer hash inlined into each pack tripled the
    graphs' compile time."""
    return rounding_noise(anchor, shape)


def _slot_bits(bits: int) -> int:
    return 1 << math.ceil(math.log2(bits))


def _quantize(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, ...]:
    slot = _slot_bits(bits)
    flat = x.reshape(-1).float()
    numel = flat.numel()
    padded = -(-numel // group_size) * group_size
    flat = torch.nn.functional.pad(flat, (0, padded - numel))  # (no branch: sizes may be symbolic)
    groups = flat.view(-1, group_size)
    lo = groups.amin(1, keepdim=True)
    span = groups.amax(1, keepdim=True) - lo
    top = (1 << bits) - 1
    step = torch.where(span > 0, span / top, torch.ones_like(span))
    u = _noise([padded // group_size, group_size], x)
    codes = torch.floor((groups - lo) / step + u).clamp_(0, top).to(torch.uint8)
    per_byte = 8 // slot
    codes = codes.view(-1, per_byte)
    payload = codes[:, 0]
    for i in range(1, per_byte):
        payload = payload | (codes[:, i] << (slot * i))
    return payload, lo, step


def _dequantize(
    payload: Tensor, lo: Tensor, step: Tensor, bits: int, group_size: int, numel: int
) -> Tensor:
    slot = _slot_bits(bits)
    per_byte = 8 // slot
    mask = (1 << slot) - 1
    parts = [(payload >> (slot * i)) & mask for i in range(per_byte)]
    codes = torch.stack(parts, 1).view(-1, group_size).float()
    return (codes * step + lo).reshape(-1)[:numel]


def _shape_spec(shape: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``shape`` as (its distinct symbolic sizes, a layout of ints and indices into them).

    PyTorch's inlining mishandles one symbol returned twice by a pack graph (a ``(b, t, t)``
    attention map): each symbol is returned once."""
    syms: list[Any] = []
    layout: list[Any] = []
    for size in shape:
        if isinstance(size, int):
            layout.append(size)
            continue
        key = str(size)
        index = next((i for i, s in enumerate(syms) if str(s) == key), None)
        if index is None:
            index = len(syms)
            syms.append(size)
        layout.append(("sym", index))
    return tuple(syms), tuple(layout)


def _shape_of(syms: tuple[Any, ...], layout: tuple[Any, ...]) -> list[Any]:
    return [s if isinstance(s, int) else syms[s[1]] for s in layout]


def _pack_graph(x: Tensor, policy: GraphPolicy, context: dict[str, Any] | None) -> Any:
    how = treatment(x, policy, context)
    if how.kind == "keep" or how.bits is None:
        return (x,)
    syms, layout = _shape_spec(x.shape)
    extra: tuple[Tensor, ...] = ()
    data = x
    if how.kind == "relu":
        extra = (_pack_mask(x),)
    elif how.exact_features:
        magnitude = x.detach().abs().flatten(0, -2).amax(0)
        index = magnitude.topk(how.exact_features).indices
        extra = (x.index_select(-1, index), index)
        data = x.index_fill(-1, index, 0)  # the rest's ranges without the outliers
    payload, lo, step = _quantize(data, how.bits, policy.group_size)
    meta = (how.kind, how.bits, layout, x.dtype, bool(how.exact_features))
    return (payload, lo, step, *extra, syms, meta)


def _pack_mask(x: Tensor) -> Tensor:
    bits = (x.reshape(-1) > 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
    bits = bits.view(-1, 8)
    out = bits[:, 0]
    for i in range(1, 8):
        out = out | (bits[:, i] << i)
    return out


def _unpack_mask(mask: Tensor, numel: int) -> Tensor:
    parts = [(mask >> i) & 1 for i in range(8)]
    return torch.stack(parts, 1).reshape(-1)[:numel].bool()


def _unpack_graph(packed: Any, policy: GraphPolicy) -> Tensor:
    if len(packed) == 1:
        return packed[0]
    kind, bits, layout, dtype, exact_features = packed[-1]
    shape = _shape_of(packed[-2], layout)
    payload, lo, step = packed[:3]
    numel = math.prod(shape)
    values = _dequantize(payload, lo, step, bits, policy.group_size, numel)
    if kind == "relu":
        keep = _unpack_mask(packed[3], numel)
        tiny = torch.finfo(dtype).tiny
        values = torch.where(keep, values.clamp_min(tiny), torch.zeros_like(values))
    values = values.to(dtype).view(shape)
    if exact_features:  # the exact features and their index
        values = values.index_copy(-1, packed[4], packed[3])
    return values


# ---------------------------------------------------------------------------------- the graphs
def _one_call_graph(fn: Any, name: str) -> SavedHooksGraph:
    graph = torch.fx.Graph()
    arg = graph.placeholder("x")
    graph.output(graph.call_function(fn, (arg,)))
    return SavedHooksGraph(torch.nn.Module(), graph, class_name=name)


@functools.lru_cache(maxsize=64)
def graph_hooks(policy: GraphPolicy) -> tuple[SavedHooksGraph, SavedHooksGraph]:
    """The (pack, unpack) graphs of ``policy``: one pair per policy, so the compiled graphs
    that inlined them are reused from step to step (PyTorch guards on their identity)."""

    def actcore_pack(x: Tensor) -> Any:
        context = _CONTEXT() if _CONTEXT is not None else None
        if context is None:  # an eager save: the active hooks' own pack
            owner = _owners()[-1]
            return _Eager(owner, owner.pack(x))
        return _pack_graph(x, policy, context)

    def actcore_unpack(packed: Any) -> Tensor:
        if isinstance(packed, _Eager):
            return packed.owner.unpack(packed.handle)
        return _unpack_graph(packed, policy)

    return (
        _one_call_graph(actcore_pack, "ActcorePack"),
        _one_call_graph(actcore_unpack, "ActcoreUnpack"),
    )
