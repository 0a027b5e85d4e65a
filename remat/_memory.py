"""A deterministic memory meter: live bytes of storages that aten ops allocate."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import optree
import torch

from . import _torch_private

__all__ = ["track"]


class track(_torch_private.TorchDispatchMode):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Count the bytes of tensor storages allocated while active, and still alive.

    Every aten op that runs inside the context (forward, backward and remat
    recomputes, on this thread and in autograd's) is seen. New storages are
    counted when created and uncounted when freed, so the numbers are exact and
    repeatable on any device, unlike allocator statistics. Views and in-place
    ops allocate nothing and are skipped, unless they resize a storage
    (``Tensor.resize_``, an ``out=`` argument that grows); storages that existed
    before the context (inputs, parameters) are not counted.

    A storage's own ``UntypedStorage.resize_`` is seen too, though no aten op
    runs: FSDP2 frees its unsharded parameters with ``resize_(0)`` and re-gathers
    them into the same storage with ``resize_(n)``. A resize counts as a new
    allocation of the new size (freeing what was counted before), so a storage
    from before the context counts from the moment it regrows inside it.

    It refuses a ``torch.compile``d function (`RuntimeError`): Dynamo would run
    it eagerly under ``track``, so the count would be eager memory's.

    Not seen: memory no tensor storage holds (allocator caches, workspaces,
    communication buffers a backend allocates itself), and a storage moved to
    shared memory (``share_memory_``), which still counts its old bytes.

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

    sees_remat = True  # remat's own copies are memory too (`_torch_private.Hidden`)

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted: dict[int, int] = {}  # id of a storage alive -> bytes counted for it
        # Storages die on whichever thread lets go last (autograd's, a communication
        # backend's): counting must not lose an update to a race.
        self._lock = threading.Lock()

    def __enter__(self) -> track:
        _torch_private.watch_storage_resizes()
        return super().__enter__()

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current ``live`` bytes."""
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _torch_private.inside_compiled_call():
            raise RuntimeError(
                "`remat.memory.track` cannot measure a torch.compile'd function: Dynamo "
                "does not compile frames run under a dispatch mode such as `track`, so "
                "what it would count is eager memory. Measure compiled memory with "
                "`torch.profiler.profile(profile_memory=True)`, or call the function "
                "without torch.compile inside `track`."
            )
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            return self._mutating(func, args, kwargs)
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        for leaf in optree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":  # holds no data
                self._count(leaf.untyped_storage())
        return out

    def _mutating(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run an op that writes in place: count the storages it resized or made."""
        storages = _storages((args, kwargs))
        before = [s.nbytes() for s in storages]
        out = func(*args, **kwargs)
        for storage, nbytes in zip(storages, before, strict=True):
            if storage.nbytes() != nbytes:
                self.storage_resized(storage)
        given = {id(s) for s in storages}
        for storage in _storages(out):
            if id(storage) not in given:
                self._count(storage)
        return out

    def storage_resized(self, storage: Any) -> None:
        """A storage reallocated to its new size (`watch_storage_resizes` calls this)."""
        key, nbytes = id(storage), storage.nbytes()
        if key not in self._counted:
            if nbytes:
                self._count(storage)
            return
        with self._lock:
            self.live += nbytes - self._counted[key]
            self._counted[key] = nbytes
            self.peak = max(self.peak, self.live)

    def _count(self, storage: Any) -> None:
        key = id(storage)
        if key in self._counted:
            return
        nbytes = storage.nbytes()
        with self._lock:
            self._counted[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            self.live -= self._counted.pop(key, 0)


def _storages(tree: Any) -> list[Any]:
    leaves: list[Any] = optree.tree_leaves(tree)
    return [
        t.untyped_storage()
        for t in leaves
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"
    ]
