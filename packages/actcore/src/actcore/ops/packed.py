"""``Packed``: a quantized tensor, as the ops produce it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["Packed"]


@dataclass(frozen=True, eq=False)
class Packed:
    """A tensor quantized per group to ``bits`` bits; see :func:`actcore.ops.quantize`.

    ``payload`` holds the packed codes (uint8, one row per sample), ``lo`` and ``step`` the
    per-group minimum and step (bfloat16). ``nbytes`` is the exact size of all three.
    """

    payload: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int
    per_sample: bool

    @property
    def device(self) -> torch.device:
        return self.payload.device

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus group metadata."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def bits_per_element(self) -> float:
        """Average storage cost per element, metadata included (0 for an empty tensor)."""
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors that hold the data (for memory accounting and saving for backward)."""
        return self.payload, self.lo, self.step

    def to(self, device: torch.device | str | None = None, *, non_blocking: bool = False):
        """A copy on ``device`` (the same object when it is already there)."""
        if device is None or torch.device(device) == self.device:
            return self
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, payload=move(self.payload), lo=move(self.lo), step=move(self.step))

    def pin_memory(self) -> Packed:
        """A copy in page-locked host memory, for asynchronous copies to and from a GPU."""
        return replace(
            self,
            payload=self.payload.pin_memory(),
            lo=self.lo.pin_memory(),
            step=self.step.pin_memory(),
        )

    def __repr__(self) -> str:
        return (
            f"Packed(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
            f"group_size={self.group_size}, per_sample={self.per_sample}, "
            f"device={self.device}, nbytes={self.nbytes})"
        )
