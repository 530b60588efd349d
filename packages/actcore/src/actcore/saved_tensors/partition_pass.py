"""What a converted model's compiled graphs ask of inductor's partitioner: recompute in
backward an elementwise value made only from tensors backward reads anyway.

The partitioner does not recompute a value that backward must materialize for a matrix
product (its ``ban_recompute_materialized_backward``): it saves it. SwiGLU's
``silu(gate) * up``, read by the down projection's weight gradient, is then saved beside
``gate`` and ``up``, which the product's own backward reads. Under ACT's inlined hooks every
saved tensor is a packing: that product was a second packed copy (at the product inputs' 2
bits, a 1376-wide Llama MLP's down-projection gradient cosine 0.73, against 0.98 for the
layer route, which derives it from the packed operands). :func:`recompute_from_saved`
marks such values for recomputation (``CheckpointPolicy.PREFER_RECOMPUTE``, which the
partitioner honours as selective checkpointing's), so backward rebuilds them from the
operands it unpacks anyway: one packed copy fewer, read at the operands' bits.

The pass is an inductor ``joint_custom_pre_pass`` (:func:`install`, while a converted
model's hooks are pushed) that acts only on graphs compiled under those hooks. Other
backends (``aot_eager``) run no joint passes: there the partition is as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["install", "recompute_from_saved", "uninstall"]


def _packets(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# deterministic elementwise ops cheap enough to replay in backward (no random ones)
_ELEMENTWISE = _packets(
    "mul", "add", "sub", "div", "neg", "silu", "gelu", "sigmoid", "tanh", "relu", "exp",
    "reciprocal", "rsqrt", "sqrt", "pow", "square", "clamp", "clamp_min", "clamp_max",
    "where", "_to_copy",
)  # fmt: skip
_VIEWS = _packets(
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "alias",
)  # fmt: skip
_DEPTH = 4  # how far back through elementwise values a recomputation may reach


def _op(node: torch.fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", node.target)


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The joint graph's backward: every node computed from a tangent."""
    todo = [n for n in graph.find_nodes(op="placeholder") if "tangents" in n.name]
    found: set[torch.fx.Node] = set()
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        todo.extend(u for u in node.users if u.op != "output")
    return found


def recompute_from_saved(graph: torch.fx.Graph) -> int:
    """Mark for recomputation the forward values of the joint ``graph`` that backward reads
    and that elementwise ops make (within :data:`_DEPTH` steps) only from graph inputs and
    values backward reads anyway. Returns how many it marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward = _backward_nodes(graph)

    def read_by_backward(node: torch.fx.Node) -> bool:
        return any(u in backward or (_op(u) in _VIEWS and read_by_backward(u)) for u in node.users)

    memo: dict[torch.fx.Node, bool] = {}

    def available(node: Any, depth: int) -> bool:
        """Whether backward has ``node`` without saving it: an input, a value it reads anyway,
        or elementwise ops of such values."""
        if not isinstance(node, torch.fx.Node) or node.op in ("placeholder", "get_attr"):
            return True
        if read_by_backward(node):
            return True
        return depth > 0 and rebuildable(node, depth - 1)

    def rebuildable(node: torch.fx.Node, depth: int) -> bool:
        if node in memo:
            return memo[node]
        memo[node] = False  # (a cycle guard; graphs have none)
        op = _op(node)
        ok = node.op == "call_function" and (op in _ELEMENTWISE or op in _VIEWS)
        ok = ok and node.meta.get("recompute") is None  # (selective checkpointing's own)
        ok = ok and all(available(a, depth) for a in node.all_input_nodes)
        memo[node] = ok
        return ok

    marked = 0
    for node in graph.nodes:
        if node in backward or node.op != "call_function" or _op(node) not in _ELEMENTWISE:
            continue
        if node.meta.get("recompute") is not None:  # (the user's selective checkpointing)
            continue
        if not read_by_backward(node):
            continue
        inputs = node.all_input_nodes
        if inputs and all(available(a, _DEPTH) for a in inputs) and rebuildable(node, _DEPTH):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            marked += 1
    return marked


def _own_hooks_active() -> bool:
    """Whether the saved-tensor hooks on top (those the graph compiled now inlines) are the
    ones :func:`install` was told are actcore's."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(True) if top is not None else None
    own = _STATE["own"]
    return bool(hooks) and own is not None and own(hooks[0])


def _pass_class() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class RecomputeFromSaved(CustomGraphPass):
        """:func:`recompute_from_saved` on graphs compiled under actcore's hooks."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            if _own_hooks_active():
                recompute_from_saved(graph)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

    return RecomputeFromSaved


_STATE: dict[str, Any] = {"pass": None, "installed": False, "saved": None, "own": None}


def install(own_hook: Callable[[Any], bool]) -> None:
    """Add the pass to inductor's ``joint_custom_pre_pass`` (after any set there) when
    inductor's config is loaded (``torch.compile`` loads it) and takes lists of passes.
    Called (under a lock) when the first converted model's hooks are pushed; ``own_hook``
    tells whether a pack hook is actcore's (the pass acts under those only)."""
    _STATE["own"] = own_hook
    config = sys.modules.get("torch._inductor.config")
    if _STATE["installed"] or config is None or not hasattr(config, "joint_custom_pre_pass"):
        return
    if _STATE["pass"] is None:
        try:
            _STATE["pass"] = _pass_class()()
        except ImportError:  # pragma: no cover - an inductor without custom graph passes
            return
    current = config.joint_custom_pre_pass
    _STATE["saved"], _STATE["installed"] = current, True
    if current is None:
        config.joint_custom_pre_pass = _STATE["pass"]
    elif isinstance(current, (list, tuple)):
        config.joint_custom_pre_pass = [*current, _STATE["pass"]]
    else:
        config.joint_custom_pre_pass = [current, _STATE["pass"]]


def uninstall() -> None:
    """Restore ``joint_custom_pre_pass`` as :func:`install` found it (when the last
    converted model's hooks are popped)."""
    if not _STATE["installed"]:
        return
    config = sys.modules["torch._inductor.config"]
    config.joint_custom_pre_pass = _STATE["saved"]
    _STATE["saved"], _STATE["installed"] = None, False
