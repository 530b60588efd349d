"""The most memory a training step (forward and backward) takes above its start."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..memory import profiled_peak_bytes

__all__ = ["loss_for", "loss_of", "step_peak"]


def step_peak(model: nn.Module, forward: Callable[[nn.Module], Any]) -> int:
    """The most bytes allocated at once during ``forward(model)`` and a backward from its
    output, beyond what was allocated before: what the step's activations, the backward's
    temporaries and its gradient buffers for the output take at their peak. The output is
    held through the backward, as a training loop holds it (a language model's logits).

    The parameters' gradients are allocated (zeros) before the step starts, as in training
    after the first step, and each parameter's ``.grad`` is given back as it was. On a CUDA
    model the allocator's own peak counts, from an emptied cache: the larger of the bytes
    allocated (``torch.cuda.max_memory_allocated``) and the bytes reserved from the device
    (``max_memory_reserved``: what the device must hold for the step, the gaps between its
    tensors included: tensors of tens of GiB can leave gaps of GiB; on an H200, a ResNet-50
    step at batch 10240 that allocated bytes put at 105 GiB, its 6 GiB of input aside, ran
    out of the card's 139 GiB); elsewhere the profiler's allocation records in time order
    (:func:`actcore.memory.profiled_peak_bytes`). A CUDA step that runs out of memory
    raises ``torch.cuda.OutOfMemoryError`` once its tensors are freed."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    with _fresh_grads(params):
        if device.type != "cuda":
            return profiled_peak_bytes(lambda: _backward(forward(model)))[1]
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the step's own segments, from an emptied cache
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        start_reserved = torch.cuda.memory_reserved(device)
        try:
            _backward(forward(model))
            torch.cuda.synchronize(device)
            return max(
                torch.cuda.max_memory_allocated(device) - start,
                torch.cuda.max_memory_reserved(device) - start_reserved,
            )
        finally:
            gc.collect()
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _fresh_grads(params: list[nn.Parameter]) -> Iterator[None]:
    held = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        yield
    finally:
        for p, grad in zip(params, held, strict=True):
            p.grad = grad


def _backward(output: Any) -> None:
    """Backward from a model's output: its ``loss`` where it has one (Hugging Face models
    given labels), else its first tensor that requires grad, with a gradient of ones."""
    loss = loss_for(output, "a step's peak")
    loss.backward(torch.ones_like(loss))


def loss_for(output: Any, purpose: str) -> torch.Tensor:
    """:func:`loss_of`, or a ValueError saying that ``purpose`` needs one."""
    loss = loss_of(output)
    if loss is None:
        raise ValueError(
            f"{purpose} needs an output that requires grad; the forward returned "
            f"{type(output).__name__} with none (is the model in a no_grad block?)"
        )
    return loss


def loss_of(output: Any) -> torch.Tensor | None:
    """A model output's ``loss`` where it has one, else its first tensor that requires
    grad (in a tuple, list or mapping), else None."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    values = output.values() if isinstance(output, Mapping) else output
    if isinstance(values, (list, tuple)) or isinstance(output, Mapping):
        for item in values:
            found = loss_of(item)
            if found is not None:
                return found
    return None
