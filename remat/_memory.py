"""A deterministic memory meter: live bytes of storages that aten ops allocate."""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch

from . import _torch_private

__all__ = ["track"]


class track(_torch_private.TorchDispatchMode):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Count the bytes of tensor storages allocated while active, and still alive.

    Every aten op that runs inside the context (forward, backward and remat
    recomputes, on this thread) is seen. New storages are counted when created
    and uncounted when freed, so the numbers are exact and repeatable on any
    device, unlike allocator statistics. Views and in-place ops allocate
    nothing and are skipped; storages that existed before the context (inputs,
    parameters) are not counted.

    Attributes:
        live: bytes allocated inside the context that are alive now.
        peak: the largest ``live`` seen since entry or the last `reset_peak`.

    Examples:
        >>> import torch, remat
        >>> x = torch.randn(256, 256, requires_grad=True)
        >>> with remat.memory.track() as mem:
        ...     y = x.sin().cos()
        ...     held = mem.live   # two 256x256 float32 intermediates
        ...     y.sum().backward()
        >>> held
        524288
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted: set[int] = set()

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current ``live`` bytes."""
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        for leaf in optree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":  # holds no data
                self._count(leaf.untyped_storage())
        return out

    def _count(self, storage: Any) -> None:
        key = id(storage)
        if key in self._counted:
            return
        nbytes = storage.nbytes()
        self._counted.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes
