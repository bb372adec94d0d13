"""Bytes a training step allocates, split into activations and model state (for the benchmarks).

``StoragePeak(model)`` is a dispatch mode: inside it every storage an op creates is followed
until it is freed, so its sums are exact and independent of the allocator (ratios between runs
mean something on a loaded machine, unlike the resident set of :mod:`peak_rss`). Unlike
``meshfold.testing.references.LiveTensors`` (what is alive at one moment) it records peaks over the step and
what was alive at them. Use::

    with StoragePeak(model) as tracked:
        loss = model.loss(tokens, targets)
        kept, _ = tracked.split(tracked.snapshot())  # activation bytes the forward keeps
        loss.backward()
    tracked.activation_peak(), tracked.peak, tracked.top(tracked.at_act_peak)
"""

from __future__ import annotations

import weakref

__all__ = ["StoragePeak"]


class StoragePeak:
    """A dispatch mode that follows every storage created under it until it is freed, and tells
    model state from activations.

    Only new storages count: an op's output that shares an input's storage (a view, an in-place
    or ``out=`` op, e.g. a weight's ``.t()`` or ``grad.add_``) is memory that existed. FSDP2
    regrows an unsharded weight's storage (``resize_``, which no op shows) before copying the
    gathered shards into it and shrinks it back to 0 bytes to free it, so the mode counts it when
    ``FSDPParamGroup.wait_for_unshard`` returns and frees it at ``FSDPParam.free_unsharded_param``.

    *Model state*: what FSDP2 allocates while it gathers, reshards or reduce-scatters (all-gather
    and reduce-scatter buffers, unsharded weights), and the weights' gradients, recognised when
    autograd hands one to its weight (a hook on each of ``model``'s parameters and FSDP2's
    unsharded weights), right after the op that made it (FSDP2's reduce-scatter marks any left).
    Everything else created in the step is *activation*: what the forward keeps for backward,
    each op's working set, the gradients of activations. :meth:`activation_peak` is the largest
    activation total, exact up to a weight gradient an op made beside an activation gradient and
    not yet handed over. Allocation ids (not data pointers, which are reused) name storages.
    """

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._record(func, out, (args, kwargs))
                return out

        self.mode = _Mode()
        self.live = {}  # storage data_ptr -> allocation id
        self.info = []  # allocation id -> [bytes, op name, shape, model state?]
        self.now = self.peak = 0
        self.at_peak = ()  # allocation ids alive at the peak
        self.in_fsdp = 0  # > 0 while FSDP2 moves model state
        self.largest = 0
        self.model = model
        self.act_now = self.act_peak = 0
        self.at_act_peak = ()  # allocation ids alive at the activation peak

    def _record(self, func, out, inputs):
        """Count the outputs of ``func`` whose storage is new: not an input's (a view, an in-place
        or ``out=`` op writes into memory that existed, such as a weight or its ``.grad``)."""
        from torch.utils._pytree import tree_leaves

        seen = {_storage(t).data_ptr() for t in tree_leaves(inputs) if _is_tensor(t)}
        for t in tree_leaves(out):
            if _is_tensor(t) and _storage(t).data_ptr() not in seen:
                self._new(t, str(func), self.in_fsdp > 0)

    def _new(self, t, op: str, state: bool):
        local = getattr(t, "_local_tensor", t)
        if local.device.type == "meta":
            return
        st = local.untyped_storage()
        key = st.data_ptr()
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = len(self.info)
        self.info.append([st.nbytes(), op, tuple(local.shape), state])
        self.now += st.nbytes()
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, tuple(self.live.values())
        if not state:
            self.act_now += st.nbytes()
            if self.act_now > self.act_peak:
                self.act_peak, self.at_act_peak = self.act_now, tuple(self.live.values())
        self.largest = max(self.largest, local.numel())
        weakref.finalize(st, self._free, key)

    def _free(self, key):
        i = self.live.pop(key, None)
        if i is not None:
            self.now -= self.info[i][0]
            if not self.info[i][3]:
                self.act_now -= self.info[i][0]

    def _mark_state(self, tensors):
        for t in tensors:
            t = getattr(t, "_local_tensor", t)  # a DTensor gradient: its shard's storage
            i = None if t is None else self.live.get(t.untyped_storage().data_ptr())
            if i is not None and not self.info[i][3]:
                self.info[i][3] = True
                self.act_now -= self.info[i][0]

    def snapshot(self) -> tuple:
        """Allocation ids alive now."""
        return tuple(self.live.values())

    def split(self, ids) -> tuple[int, int]:
        """(activation bytes, model-state bytes) of allocation ids."""
        act = sum(self.info[i][0] for i in ids if not self.info[i][3])
        return act, sum(self.info[i][0] for i in ids) - act

    def allocated(self) -> tuple[int, int]:
        """(activation bytes, model-state bytes) allocated over the whole step, freed or not."""
        return self.split(range(len(self.info)))

    def top(self, ids, n=8) -> list:
        """The ``n`` largest (MiB, count, op, shape, model state?) groups of allocation ids."""
        groups = {}
        for i in ids:
            nbytes, op, shape, state = self.info[i]
            g = groups.setdefault((op, shape, state), [0, 0])
            g[0] += nbytes
            g[1] += 1
        rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:n]
        return [(round(b / 2 ** 20, 2), c, op, list(shape), state) for (op, shape, state), (b, c) in rows]

    def _patches(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        tracker = self

        def moving_state(fn, name):
            def wrapped(group, *args, **kwargs):
                if name == "post_backward":  # the unsharded gradients it is about to reduce-scatter
                    tracker._mark_state(g for p in group.fsdp_params if hasattr(p, "_unsharded_param")
                                        for g in (p.unsharded_accumulated_grad, p._unsharded_param.grad))
                tracker.in_fsdp += 1
                try:
                    return fn(group, *args, **kwargs)
                finally:
                    tracker.in_fsdp -= 1
                    if name == "wait_for_unshard":  # storages regrown by resize_, which no op shows
                        for p in group.fsdp_params:
                            for t in (*p.all_gather_outputs, *p._unsharded_inner_tensors):
                                tracker._new(t, "FSDP2 unsharded weight", True)
            return wrapped

        def freeing(fn):
            def wrapped(param):
                for t in (*param.all_gather_outputs, *param._unsharded_inner_tensors):
                    tracker._free(t.untyped_storage().data_ptr())
                return fn(param)
            return wrapped

        return [(FSDPParamGroup, name, moving_state(getattr(FSDPParamGroup, name), name))
                for name in ("unshard", "wait_for_unshard", "reshard", "post_backward")] + \
            [(FSDPParam, "free_unsharded_param", freeing(FSDPParam.free_unsharded_param))]

    def activation_peak(self) -> int:
        """Bytes of activation at the activation peak (labels as known at the end)."""
        return self.split(self.at_act_peak)[0]

    def __enter__(self):
        from torch.distributed.fsdp import FSDPModule

        unsharded = [fp._unsharded_param for m in self.model.modules() if isinstance(m, FSDPModule)
                     for group in [m._get_fsdp_state()._fsdp_param_group] if group is not None
                     for fp in group.fsdp_params if hasattr(fp, "_unsharded_param")]
        self._hooks = [p.register_hook(lambda g: self._mark_state([g]))
                       for p in [*self.model.parameters(), *unsharded] if p.requires_grad]
        self._saved = []
        for cls, name, fn in self._patches():
            self._saved.append((cls, name, getattr(cls, name)))
            setattr(cls, name, fn)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)
        for h in self._hooks:
            h.remove()


def _is_tensor(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor)


def _storage(t):
    return getattr(t, "_local_tensor", t).untyped_storage()
