"""The hooks route inside ``torch.compile``: pack and unpack inlined into the compiled graphs.

PyTorch inlines saved-tensor hooks that are fx graphs into the graphs it compiles: the pack
graph into the forward graph's epilogue, once per saved intermediate, and the unpack graph
into the backward graph's prologue (``torch._functorch``'s saved-tensor-hook inlining; the
compiled runtime then saves the packed tensors with the hooks off). The quantization and
the mask are the native kernels, called from the graph as opaque ops; inductor fuses the
rest of each pack and unpack (channel scales, selects) with the ops around them (C++ on
CPU, Triton on CUDA), and nothing breaks the graph.

:class:`~actcore.saved_tensors.hooks.SavedTensorHooks` therefore pushes a pair of
:class:`SavedHooksGraph` (one pair per :class:`GraphPolicy`, cached: PyTorch guards a compiled
graph on the hooks' identity, so a new pair would recompile). Called eagerly, outside a
compiled graph, they hand each tensor to the active ``SavedTensorHooks``' own pack and unpack
(the eager route, unchanged). Traced into a compiled graph, they see the saved node, its
producer and its consumers in the backward graph, and treat it by kind
(:func:`actcore.saved_tensors.graph_treatment.treatment`):

* kept as it is: non-float tensors, fewer than ``min_numel`` elements, a softmax's input
  (logits: backward exponentiates them against their max), reductions and normalization
  statistics, an attention's logsumexp, q and k of an attention backward that reads a
  saved logsumexp (its kernel rebuilds the probabilities as ``exp(q k^T - logsumexp)``),
  and (with ``exact_ops``) anything a comparison, division, power, log or exp in backward
  reads, or reads through ``sin`` or ``cos``, elementwise ops between (rotary positions and
  angles: hundreds of radians);
* q and k of an attention that backward recomputes (``F.scaled_dot_product_attention``
  under the hooks, see :class:`~actcore.saved_tensors.op_mode.OpMode`): at least
  ``nonlinear_bits``, their features of largest magnitude exact;
* at 1 bit an element, exactly: a bool tensor (a ``where``'s condition, a dropout mask), and a
  float tensor that holds one of two constants chosen by a bool (``where(cond, 0, -inf)``:
  the causal mask Hugging Face's sdpa path builds under torch.compile);
* a tensor backward reads only through ``exp`` (less values that do not depend on it):
  log-probabilities saved for a log-softmax's backward, or logits that inductor's partitioner
  saves to recompute it: ``exp(x - rowmax)`` quantized, the row maxima exact. The log-softmax
  backward is linear in that exponential, so its stochastic rounding leaves the gradient
  unbiased (quantizing the log-probabilities themselves would not: ``E[exp(q(x))] > exp(x)``);
* a ReLU output: its 1-bit nonzero mask plus its values at the level's bits (the mask makes
  the ReLU's backward exact); the mask alone where backward reads nothing else of it (its
  own ``threshold_backward``, a max pool's backward, which reads only its shape);
* a statistic (made from a reduction by size-keeping ops, a norm's ``rsqrt(var + eps)``
  after inductor's decompositions): kept;
* with a converted model's bits by kind (:class:`~actcore.saved_tensors.graph_treatment.KindBits`,
  its level's): the input of a convolution or matrix product, a batch norm, a layer /
  group / RMS norm or a smooth activation, recognised by the forward ops that read it (the
  decomposed ones too), gets that kind's bits (the most of its kinds; probabilities at
  least ``nonlinear_bits``);
* a tensor from which backward takes a norm's statistics (a fused layer norm replayed whole,
  a ``var_mean`` or a mean of squares, directly or through elementwise ops): at least
  :data:`~actcore.saved_tensors.graph_treatment.RECOMPUTED_STATISTICS_BITS`;
* read only by matrix products and convolution backward (and as an attention's v or
  output, which its backward reads linearly): the level's bits;
* otherwise (a smooth activation's input, a softmax / sigmoid / tanh output, a norm's input):
  at least ``nonlinear_bits`` (the hooks route's
  :data:`~actcore.saved_tensors.hooks.ACTIVATION_BITS`).

The quantization is the native kernels' stochastic rounding over groups of ``group_size``
elements (``actcore::quantize_fresh``: an opaque op that draws its seed when the graph runs,
so the graph holds no seed, nothing recompiles per step and torch's generators are
untouched), codes packed at their bits, each group's minimum and step in bfloat16, as the
eager route stores them; ``actcore::dequantize`` reverses it in the backward graph.
Forward outputs are those of the compiled plain graph: only what is saved changes.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..ops.library import dequantize, pack_bits, relu_mask, unpack_bits
from ..ops.masked import kept_floor
from ..ops.pool_index import flat_index, window_offset
from ..ops.seeds import quantize_fresh
from . import partition_pass
from .graph_treatment import GraphPolicy, treatment
from .handles import Handle

__all__ = ["SavedHooksGraph", "graph_hooks", "inlining_supported", "is_own_graph"]


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


class SavedHooksGraph(torch.fx.GraphModule):
    """A one-node fx graph calling an actcore pack or unpack function: what PyTorch inlines
    into compiled graphs, and an ordinary hook when called eagerly.

    Called, it runs the function directly (``act_fn``, the graph's one call): an eager step
    calls a hook twice per saved tensor, and ``nn.Module``'s call machinery and the generated
    ``forward`` took more time than a passed-through tensor's own handling. Tracing (AOTAutograd
    inlining the hook) records the same function's ops either way."""

    act_fn: Any
    act_holds_packings: Any  # (the pack graph: see _passes_packings)

    def __call__(self, x: Any) -> Any:
        return self.act_fn(x)


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
    crosses a graph break (an input of the next graph) would be kept whole. Meanwhile
    inductor's partitioner runs :mod:`.partition_pass`."""
    import torch._functorch.config as functorch_config

    _owners().append(hooks)
    with _FILTERING_LOCK:
        if not _FILTERING["pushed"]:
            _FILTERING["saved"] = functorch_config.saved_tensors_hooks_filtering_mode
            functorch_config.saved_tensors_hooks_filtering_mode = "no_static"
            partition_pass.install(is_own_graph)
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
                    partition_pass.uninstall()
            return


# ------------------------------------------------------------------------------ quantization
def _quantize(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, ...]:
    """``x``'s elements in memory order, rounded stochastically in groups of ``group_size``
    (``actcore::quantize_fresh``: the native kernel, under a seed drawn when the graph runs).
    An opaque op to inductor: written in ATen ops for inductor to fuse, with a noise tensor
    beside them, it made a char GPT's compiled step 2.14x compiled plain's (1.55x with the
    native kernel) and took twice the compile time."""
    return quantize_fresh(x.contiguous(), bits, group_size, False)


def _dequantize(
    payload: Tensor, lo: Tensor, step: Tensor, bits: int, group_size: int, numel: int, dtype: Any
) -> Tensor:
    return dequantize(payload, lo, step, bits, group_size, [numel], dtype, False)


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


def _memory_order(x: Tensor) -> tuple[int, ...]:
    """The permutation of ``x``'s dims in memory order, outermost first (the identity for a
    contiguous tensor): packed in that order, the unpacked tensor gets ``x``'s strides back,
    which the backward graph's views of it may rely on (a transposed saved tensor)."""
    from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

    order, _ = compute_elementwise_output_logical_to_physical_perm(x)
    return tuple(order)


def _pack_order(x: Tensor, channel_dim: int) -> tuple[int, ...]:
    """The order of ``x``'s dims in which it is packed: its memory order, except that the
    channels of a ``[N, C, *spatial]`` tensor (``channel_dim`` 1) come right after the batch,
    whatever its memory format. A channels-last tensor in memory order puts every channel of
    a few pixels in one quantization group, whose range then spans all channels; channel by
    channel a group holds neighbouring pixels of one channel, with a narrower range (as the
    layer route packs it). ResNet-18 compiled in channels-last at L3: gradient cosine 0.69-0.74
    in memory order, 0.81-0.82 in this one, as contiguous."""
    order = _memory_order(x)
    if channel_dim % max(x.dim(), 1) != 1 or x.dim() < 3 or order[1] == 1:
        return order
    rest = [d for d in order if d != 1]
    return (rest[0], 1, *rest[1:])


def _pack_graph(x: Tensor, policy: GraphPolicy, context: dict[str, Any] | None) -> Any:
    how = treatment(x, policy, context)
    if how.kind == "index":  # (``to`` keeps the strides)
        return (x.to(how.dtype), ("index", x.dtype))
    if how.kind == "offset":  # (max-pooling indices: an output's argmax inside its window)
        assert how.window is not None and how.bits is not None
        spatial, *window = how.window
        if how.dtype is None:  # (flat indices into the plane)
            offset = window_offset(x.contiguous(), spatial, *window).to(torch.uint8)
        else:  # (offsets already)
            offset = x.contiguous().to(torch.uint8)
        syms, layout = _shape_spec(x.shape)
        meta = ("offset", how.bits, layout, how.window, _memory_order(x), how.dtype)
        return (pack_bits(offset.reshape(-1), how.bits), syms, meta)
    if how.kind == "keep" or (how.bits is None and how.kind not in _ONE_BIT_KINDS):
        return (x,)
    order = _pack_order(x, how.channel_dim)
    memory = _memory_order(x)  # (restored on unpack, where the pack's order differs)
    data = x.permute(order).contiguous()  # (once: the mask and the codes read the same)
    syms, layout = _shape_spec(data.shape)
    parts: dict[str, Tensor] = {}
    extra: Any = None
    if how.kind in ("mask", "relu"):
        parts["mask"] = _pack_mask(data)
    if how.kind == "bits":
        parts["mask"] = _pack_bool(data)
    elif how.kind == "select":
        extra = how.values
        parts["mask"] = _pack_bool(data == how.values[0])
    elif how.kind == "exp":  # backward reads exp(x): an unbiased estimate of it, in (0, 1]
        # (a row all -inf shifts by the lowest finite value: its exp stays 0, not NaN)
        lowest = torch.finfo(data.dtype).min
        parts["shift"] = data.detach().amax(-1, keepdim=True).clamp_min(lowest)
        parts["payload"], parts["lo"], parts["step"] = _quantize(
            torch.exp(data - parts["shift"]), how.bits, policy.group_size
        )
    elif how.kind != "mask":
        if how.exact_features:
            magnitude = x.detach().abs().flatten(0, -2).amax(0)
            index = magnitude.topk(how.exact_features).indices
            parts["exact"], parts["index"] = x.index_select(-1, index).permute(order), index
            data = x.index_fill(-1, index, 0).permute(order)  # the rest without the outliers
        channels = order.index(how.channel_dim % x.dim()) if x.dim() else 0
        if how.normalized:  # (each channel centred and scaled: its rounding step follows its
            # spread over the batch, not its magnitude; a few values per channel with a large
            # mean otherwise came back with an error the norm's 1 / std multiplies)
            parts["centre"], parts["scale"] = _channel_spread(data, channels)
            data = (data - parts["centre"]) / parts["scale"]
        elif how.kind == "quantize" and _groups_mix_channels(data, channels, policy.group_size):
            parts["scale"] = _channel_scale(data, channels)
            data = data / parts["scale"]
        parts["payload"], parts["lo"], parts["step"] = _quantize(data, how.bits, policy.group_size)
    names = tuple(parts)
    meta = (how.kind, how.bits, layout, x.dtype, order, names, extra, memory)
    return (*parts.values(), syms, meta)


_ONE_BIT_KINDS = ("mask", "bits", "select")  # (kept at 1 bit an element: no bits to give)


def _groups_mix_channels(data: Tensor, dim: int, group_size: int) -> bool:
    """Whether quantization groups of ``group_size`` consecutive elements of ``data`` (in
    memory order) hold elements of more than one channel along ``dim``: unless the elements
    inside one channel's slice (the dims after ``dim``) are a multiple of ``group_size``
    (a convolution's channel of 64 x 64 pixels in NCHW order). A symbolic size: assume so."""
    if data.dim() < 2:
        return False
    inner = math.prod(data.shape[dim + 1 :])
    return not isinstance(inner, int) or inner % group_size != 0


def _channel_scale(data: Tensor, dim: int) -> Tensor:
    """A power of two per channel of ``data`` along ``dim``, at least its largest magnitude
    (shaped to broadcast against ``data``): divided by it, every channel spans at most
    [-1, 1], so one outlier channel no longer sets the rounding step of a whole group (the
    layer route's :class:`~actcore.compressors.ChannelScaled`, in the traceable form).
    Powers of two divide and multiply exactly, so stochastic rounding stays unbiased."""
    others = [d for d in range(data.dim()) if d != dim]
    amax = data.detach().abs().amax(others, keepdim=True).float()
    tiny = torch.finfo(data.dtype).tiny  # (an all-zero channel: a scale the dtype holds)
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(tiny)))).to(data.dtype)


def _channel_spread(data: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Per channel of ``data`` along ``dim``: its mean, and a power of two at least its
    standard deviation (shaped to broadcast against ``data``). ``(data - mean) / scale`` is
    then within a few units whatever the channel's magnitude; a power of two divides and
    multiplies exactly, so stochastic rounding stays unbiased."""
    others = [d for d in range(data.dim()) if d != dim]
    var, mean = torch.var_mean(data.detach().float(), others, correction=0, keepdim=True)
    tiny = torch.finfo(data.dtype).tiny  # (a constant channel: a scale the dtype holds)
    scale = torch.exp2(torch.ceil(torch.log2(var.sqrt().clamp_min(tiny))))
    return mean.to(data.dtype), scale.to(data.dtype)


def _pack_mask(x: Tensor) -> Tensor:
    """Where ``x`` (a ReLU's output, contiguous in its memory order) is not ``<= 0``, 1 bit
    per element: where the ReLU's backward passes the gradient (``actcore::relu_mask``, one
    native pass)."""
    return relu_mask(x)


def _pack_bool(x: Tensor) -> Tensor:
    """A bool tensor's elements (contiguous in its memory order), 1 bit each."""
    return pack_bits(x.reshape(-1).to(torch.uint8), 1)


def _unpack_mask(mask: Tensor, numel: int) -> Tensor:
    # (compared, not viewed as bool: inductor's C++ code cannot vectorize a bool view; and
    # widened first: a select on a uint8 comparison took it 10.3 ms for 3.2M elements, on an
    # int32 one 0.8 ms)
    return unpack_bits(mask, 1, numel).to(torch.int32) != 0


def _with_strides(t: Tensor, memory: tuple[int, ...]) -> Tensor:
    """``t`` with its dims laid out in memory in the order ``memory`` (outermost first)."""
    if memory == tuple(range(t.dim())):
        return t.contiguous()
    return t.permute(memory).contiguous().permute([memory.index(i) for i in range(t.dim())])


def _unpack_graph(packed: Any, policy: GraphPolicy) -> Tensor:
    if len(packed) == 1:
        return packed[0]
    if len(packed) == 2:  # ("index", dtype)
        return packed[0].to(packed[1][1])
    if packed[-1][0] == "offset":
        _, bits, layout, (spatial, *window), memory, dtype = packed[-1]
        shape = _shape_of(packed[-2], layout)
        offset = unpack_bits(packed[0], bits, math.prod(shape)).view(shape)
        if dtype is not None:
            return _with_strides(offset.to(dtype), memory)
        return _with_strides(flat_index(offset, spatial, *window), memory)
    kind, bits, layout, dtype, order, names, extra, memory = packed[-1]
    parts = dict(zip(names, packed[: len(names)], strict=True))
    shape = _shape_of(packed[-2], layout)  # in the order packed
    numel = math.prod(shape)

    def restore(t: Tensor) -> Tensor:  # from the pack's order to x's dims and strides
        t = t.permute([order.index(i) for i in range(len(order))])
        return t if memory == order else _with_strides(t, memory)

    if kind == "bits":
        return restore(_unpack_mask(parts["mask"], numel).view(shape))
    if kind == "select":  # (the two values as the saved tensor held them: exactly)
        where_set, elsewhere = (
            torch.full((), v, dtype=dtype, device=parts["mask"].device) for v in extra
        )
        chosen = torch.where(_unpack_mask(parts["mask"], numel), where_set, elsewhere)
        return restore(chosen.view(shape))
    if kind == "mask":  # kept_floor where the ReLU's output was not <= 0: all its backward
        # reads (the bits times kept_floor: exact, and one product where a select took two)
        kept = unpack_bits(parts["mask"], 1, numel).to(dtype) * kept_floor(dtype)
        return restore(kept.view(shape))
    values = _dequantize(
        parts["payload"], parts["lo"], parts["step"], bits, policy.group_size, numel, dtype
    ).view(shape)
    if kind == "exp":  # the log of the restored exp(x - shift) (>= 0: never NaN), shifted back
        return restore(torch.log(values.clamp_min(0)) + parts["shift"])
    if "scale" in parts:
        values = values * parts["scale"]
    if "centre" in parts:
        values = values + parts["centre"]
    if kind == "relu":  # the ReLU's zeros exactly, the rest at least kept_floor (positive)
        keep = _unpack_mask(parts["mask"], numel).view(shape)
        values = torch.where(keep, values.clamp_min(kept_floor(dtype)), torch.zeros_like(values))
    if "exact" in parts:  # the exact features and their index (the last dim, in memory order)
        last = order.index(len(order) - 1)
        values = values.index_copy(last, parts["index"], parts["exact"])
    return restore(values)


# ---------------------------------------------------------------------------------- the graphs
_OWN_GRAPHS: weakref.WeakSet[Any] = weakref.WeakSet()


def is_own_graph(hook: Any) -> bool:
    """Whether ``hook`` is one of the pack / unpack graphs of :func:`graph_hooks`."""
    try:
        return hook in _OWN_GRAPHS
    except TypeError:
        return False


def _one_call_graph(fn: Any, name: str) -> SavedHooksGraph:
    graph = torch.fx.Graph()
    arg = graph.placeholder("x")
    graph.output(graph.call_function(fn, (arg,)))
    module = SavedHooksGraph(torch.nn.Module(), graph, class_name=name)
    # GraphModule gives each instance a class of its own whose __call__ (set by recompile)
    # wraps the generated forward: this one's is the direct call
    type(module).__call__ = SavedHooksGraph.__call__
    module.act_fn = fn
    _OWN_GRAPHS.add(module)
    return module


@functools.lru_cache(maxsize=64)
def graph_hooks(policy: GraphPolicy) -> tuple[SavedHooksGraph, SavedHooksGraph]:
    """The (pack, unpack) graphs of ``policy``: one pair per policy, so the compiled graphs
    that inlined them are reused from step to step (PyTorch guards on their identity)."""

    def actcore_pack(x: Tensor) -> Any:
        context = _CONTEXT() if _CONTEXT is not None else None
        if context is None:  # an eager save: the active hooks' own pack
            owner = _owners()[-1]
            handle = owner.pack(x)  # (a Handle restores itself: no wrapper to allocate)
            return handle if isinstance(handle, Handle) else _Eager(owner, handle)
        owners = _owners()
        if owners:  # traced now, on the thread that runs the forward
            owners[-1].note_compiled_save()
        return _pack_graph(x, policy, context)

    def actcore_unpack(packed: Any) -> Tensor:
        if isinstance(packed, Handle):  # (what SavedTensorHooks.unpack does with it)
            return packed.restore()
        if isinstance(packed, _Eager):
            return packed.owner.unpack(packed.handle)
        return _unpack_graph(packed, policy)

    pack = _one_call_graph(actcore_pack, "ActcorePack")
    pack.act_holds_packings = _passes_packings  # (asked by actcore.layers.stash)
    return pack, _one_call_graph(actcore_unpack, "ActcoreUnpack")


def _passes_packings() -> bool:
    """Whether the hooks now saving eagerly on this thread would pass a Q-layer's packed
    tensors through untouched (no hooks enclosing them to hand those on to)."""
    owners = _owners()
    return bool(owners) and owners[-1].passes_packings()
