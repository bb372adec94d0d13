"""The bytes of the tensor storages alive in this process, and their peak, where no allocator
counts them (the CPU: PyTorch keeps allocator statistics for accelerators only).

:class:`LiveBytes` is a dispatch mode. Every storage it sees (an op's output or input, or one
handed to :meth:`LiveBytes.adopt`) is counted once, by identity, for as long as it lives: a weak
reference to the storage takes its bytes off when the last tensor on it dies. So a view, an
in-place or ``out=`` op, or a collective writing into its input adds nothing. DTensor is counted
through its local shards (the mode lets DTensor turn its ops into ops on plain tensors first);
other tensor subclasses through the plain tensors inside their outputs; fake and meta tensors,
which hold no memory, not at all. A storage resized in place (FSDP2 grows an unsharded weight's
storage with ``UntypedStorage.resize_``, which no op shows, and shrinks it to 0 bytes to free
it) is followed by wrapping that method while the mode is active, as
``torch.distributed._tools.mem_tracker.MemTracker`` does.

What it sees is what runs on the thread that entered it, including autograd's backward on the
CPU (the engine carries the mode over). Tensors made and freed on other threads (a worker's
temporaries) are not seen; a tensor a worker hands back is counted when an op here first uses
it. A storage freed on another thread (a gloo or pool thread holding its last tensor) is taken
off there, under the interpreter lock like every update of the counts.

    >>> live = LiveBytes()
    >>> with live:
    ...     x = torch.empty(1 << 20, dtype=torch.uint8)
    ...     y = x[10:].mul_(2)  # a view and an in-place op: no new storage
    >>> live.now, live.peak
    (1048576, 1048576)
    >>> del x, y
    >>> live.now, live.peak
    (0, 1048576)
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["LiveBytes", "holders"]

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def holders(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold ``t``'s data: ``t`` itself, or for a wrapper subclass the
    tensors it wraps, unwrapped in turn (a DTensor's local shard, an ``AsyncCollectiveTensor``'s
    collective output). A wrapper's own storage is a placeholder with no data behind it."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])  # DTensor lists its mesh too
    return [h for x in inner if isinstance(x, torch.Tensor) for h in holders(x)]


class LiveBytes(TorchDispatchMode):
    """Counts live storage bytes (``now``) and their largest value (``peak``); see the module.
    ``reset_peak()`` starts a new interval (a training step) at the bytes alive now. It may be
    entered again after it exits; what it counted stays counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, list] = {}  # a storage's StorageImpl address -> [bytes, weak reference]
        self._resize = None

    def reset_peak(self) -> None:
        self.peak = self.now

    def adopt(self, tensors) -> None:
        """Count the storages of ``tensors`` (made before the mode saw them: a model's weights, its
        optimizer's state) if they are not counted yet. Tensor subclasses count their inner tensors."""
        for t in tensors:
            if t is not None:
                self._see_tree(t)

    def __enter__(self):
        original = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            out = original(storage, nbytes)
            self._see_storage(storage)
            return out

        self._resize = (vars(torch.UntypedStorage).get("resize_"), self._resize)
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        own, self._resize = self._resize
        if own is None:
            del torch.UntypedStorage.resize_  # inherited again
        else:
            torch.UntypedStorage.resize_ = own
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _PLAIN.issuperset(types) and any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its ops on its local tensors, seen here then
        out = func(*args, **(kwargs or {}))
        self._see_tree(out)
        self._see_tree(args)  # a tensor made where the mode did not see it (another thread)
        return out

    def _see_tree(self, x) -> None:
        if isinstance(x, torch.Tensor):
            for h in holders(x):
                if type(h) in _PLAIN:  # not fake or other unwrapped subclasses: they hold no memory
                    self._see_storage(h.untyped_storage())
        elif isinstance(x, (tuple, list)):
            for y in x:
                self._see_tree(y)

    def _see_storage(self, st) -> None:
        key = st._cdata
        entry = self._live.get(key)
        nbytes = st.nbytes()
        if entry is None:
            if st.device.type == "meta":
                return
            self._live[key] = [nbytes, weakref.ref(st, partial(self._freed, key))]
            self.now += nbytes
        elif entry[0] != nbytes:  # resized in place since it was last seen
            self.now += nbytes - entry[0]
            entry[0] = nbytes
        else:
            return
        if self.now > self.peak:
            self.peak = self.now

    def _freed(self, key, _ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.now -= entry[0]
