"""References and instruments for tests: the single-device model the folded ones are compared
with, a counter of checkpoint reads, the bytes of the tensors an op leaves alive, and CPU
tensors that report another device (accelerator paths tested on a CPU)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["reference_model", "reference_transformer", "checkpoint_reads", "LiveTensors", "OffCPU"]


def reference_model(build, seed: int, B: int, S: int, vocab: int):
    """``(model, tokens, targets)``: the single-device model ``build()`` makes after
    ``torch.manual_seed(seed)``, its constant-initialized parameters (norms, biases) moved off
    their initial values (:func:`~meshfold.testing.equivalence.perturb_constants`, so a layout
    that misapplies one shows), and a global [B, S] batch of tokens and targets below ``vocab``
    from ``seed + 1``: what folded equality tests compare against."""
    from meshfold.testing.equivalence import perturb_constants

    torch.manual_seed(seed)
    model = build()
    perturb_constants(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    targets = torch.randint(0, vocab, (B, S), generator=g)
    return model, tokens, targets


def reference_transformer(cfg, seed: int, B: int, S: int):
    """:func:`reference_model` of an fp64 MoETransformer of ``cfg``."""
    from meshfold.models.transformer import MoETransformer

    return reference_model(lambda: MoETransformer(cfg, dtype=torch.float64), seed, B, S, cfg.vocab)


@contextmanager
def checkpoint_reads():
    """Inside the block, every slice read from a Hugging Face checkpoint by
    :mod:`meshfold.interop.hf` appends its element count to the yielded list (to check that a
    folded load reads only a rank's own shards)."""
    from meshfold.interop import hf

    read: list[int] = []
    original = hf._Checkpoint.slice

    class Counting:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, idx):
            t = self.sl[idx]
            read.append(t.numel())
            return t

    hf._Checkpoint.slice = lambda self, key, param: Counting(original(self, key, param))
    try:
        yield read
    finally:
        hf._Checkpoint.slice = original


class LiveTensors:
    """Context: every tensor an op creates while it is active, held weakly; ``bytes()`` is the
    storage bytes of those still alive (each storage counted once; FSDP2's freed unsharded
    weights count 0). Within a forward, the growth is what the forward keeps for backward;
    after a whole step, it is what the step leaks. Works on any device (a dispatch mode).
    ``exclude``: tensors whose storages are not counted (a model's parameters and buffers, which
    views made during the forward share)."""

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        refs = self._refs = []

        class _Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                refs.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
                return out

        self._mode = _Record()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def bytes(self) -> int:
        self._refs[:] = [r for r in self._refs if r() is not None]
        storages = {}
        for r in self._refs:
            t = r()
            t = getattr(t, "_local_tensor", t)  # a DTensor: its shard's storage
            if t is not None and not t.is_meta and type(t) in (torch.Tensor, torch.nn.Parameter):
                s = t.untyped_storage()
                if s.data_ptr() in self._exclude:
                    continue
                storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return sum(storages.values())


class OffCPU(torch.Tensor):
    """A CPU tensor that reports another device (``meta``): code that branches on
    ``tensor.device.type != "cpu"`` takes its accelerator path, while every op still computes on
    the CPU values inside (results come back wrapped). For testing device-dependent choices on a
    machine without an accelerator. Inside ``with OffCPU.everywhere():`` factories given the
    reported device (``torch.arange(n, device=x.device)``) build such tensors too."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, strides=inner.stride(),
                                                   device=torch.device("meta"), requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __repr__(self):
        return f"OffCPU({self.inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _off_cpu_call(func, args, kwargs)

    @staticmethod
    def everywhere():
        """A mode in which factories asked for the meta device build OffCPU tensors."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return _off_cpu_call(func, args, kwargs)

        return _Mode()


def _off_cpu_call(func, args, kwargs):
    from torch.utils._pytree import tree_map

    def unwrap(t):
        if isinstance(t, OffCPU):
            return t.inner
        return torch.device("cpu") if isinstance(t, torch.device) and t.type == "meta" else t

    kwargs = {k: ("cpu" if k == "device" and str(v) == "meta" else v) for k, v in (kwargs or {}).items()}
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    return tree_map(lambda t: OffCPU(t) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, out)
