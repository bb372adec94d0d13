"""An MoE layer forward reads device data on the host at most once: the counts that size the
dispatch's all-to-all (single device: the kept rows when dropping; dropless: nothing).

On CPU nothing really syncs, so the forward runs under :class:`HostSyncCounter`, which records
every op that would make the host wait for the device on an accelerator:

* device -> host reads: ``aten._local_scalar_dense`` (``.item()``, ``int()``, ``bool()`` of a
  tensor), ``Tensor.tolist()`` and ``.numpy()`` (which dispatch no op on CPU, so they are wrapped),
  copies to the CPU from another device, and ops whose output shape depends on tensor data
  (``nonzero``, boolean-mask indexing, ``masked_select``, ``repeat_interleave`` without
  ``output_size``, ``unique``, ``bincount``) or that return a host bool (``equal``, ``is_nonzero``);
* host -> device uploads of Python data: ``torch.tensor(...)`` / ``torch.as_tensor(list)`` show up
  as ``aten.lift_fresh`` (on CPU one cannot tell an upload from a host-only tensor, so every one
  counts). Constants built by a kernel (``torch.full``, ``arange``) are not copies and do not count.

Not seen: reads inside an opaque op (a custom op's CPU kernel, e.g. the expert GEMM reading its
offsets on CPU while the Triton kernel on CUDA reads none) and work on other threads (the test runs
with one intra-op thread, so the CPU pool runs its parts on the caller's thread). The grouped GEMM's
offset check, which runs only for CPU offsets, is switched off here.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig, MoELayer
from meshfold.parallel.moe import parallelize_moe
from meshfold.testing.worlds import cached_fold

aten = torch.ops.aten

_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
          aten.equal.default, aten.is_nonzero.default, aten.bincount.default, aten._unique2.default,
          aten.unique_dim.default, aten.unique_consecutive.default, aten._unique.default}
_UPLOADS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _where() -> str:
    """The innermost meshfold frame outside this file: the line that caused the sync."""
    for frame in reversed(traceback.extract_stack()):
        if "/meshfold/" in frame.filename and "test_host_syncs" not in frame.filename:
            return f"{frame.filename.rsplit('/meshfold/', 1)[-1]}:{frame.lineno} {frame.line}"
    return "?"


def _sync_kind(func, args, kwargs) -> str | None:
    if func in _READS:
        return f"read ({func})"
    if func in _UPLOADS:
        return f"upload ({func})"
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return f"read (boolean-mask {func})"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size", args[1] if len(args) > 1 else None) is None:
        return f"read ({func} without output_size)"
    if func in (aten._to_copy.default, aten.copy_.default):
        src, dst_device = args[0], kwargs.get("device")
        if func is aten.copy_.default:
            src, dst_device = args[1], args[0].device
        if dst_device is not None and torch.device(dst_device).type == "cpu" and src.device.type != "cpu":
            return f"read ({func} to the CPU)"
    return None


class HostSyncCounter(TorchDispatchMode):
    """Records ``(kind, source line)`` for every host sync an accelerator would make (module
    docstring) while active; ``syncs`` lists them."""

    def __init__(self):
        super().__init__()
        self.syncs: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _sync_kind(func, args, kwargs)
        if kind is not None:
            self.syncs.append((kind, _where()))
        return func(*args, **kwargs)

    def _host_read(self, name, original):
        def wrapped(t, *a, **kw):
            if _get_current_dispatch_mode() is self:  # not inside an opaque op, where the mode is off
                self.syncs.append((f"read (Tensor.{name})", _where()))
            return original(t, *a, **kw)
        return wrapped

    def __enter__(self):
        self._patches = contextlib.ExitStack()
        for name in ("tolist", "numpy"):
            self._patches.enter_context(_patched(torch.Tensor, name, self._host_read(name, getattr(torch.Tensor, name))))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def _as_on_an_accelerator():
    """One intra-op thread (the CPU pool runs on the caller's thread, where the mode sees it) and
    no CPU-only offset check in the grouped GEMM."""
    import importlib

    grouped_mm = importlib.import_module("meshfold.kernels.grouped_mm")  # the module, not the function
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _patched(grouped_mm, "_check_offset_values", lambda offsets, M: None):
            yield
    finally:
        torch.set_num_threads(threads)


def count_forward_syncs(layer: MoELayer, x: torch.Tensor) -> list[tuple[str, str]]:
    """The host syncs of ``layer(x)`` (forward only), after a first forward that builds what is
    cached once per layer (the dispatch block's sub-mesh, whose slicing reads the CPU mesh)."""
    layer(x)
    with _as_on_an_accelerator(), HostSyncCounter() as counter:
        layer(x)
    return counter.syncs


MODES = {
    "dropless": dict(),
    "sub_sequence": dict(capacity_factor=1.0, drop_scope="sub_sequence"),
    "full_sequence": dict(capacity_factor=1.0, drop_scope="full_sequence", drop_policy="position"),
    "padded": dict(capacity_factor=1.0, drop_scope="sub_sequence", pad_to_capacity=True),
}


def _layer_cfg(mode: str, etp: int = 1, tp: int = 1) -> MoEConfig:
    # every loss and the shared expert on, so every token statistic is computed
    return MoEConfig(hidden=4, ffn=2 * etp, num_experts=4, topk=2, shared_ffn=2 * tp,
                     aux_loss_coeff=0.1, seq_aux_loss_coeff=0.1, global_aux_loss_coeff=0.1,
                     z_loss_coeff=0.01, expert_bias=True, **MODES[mode])


def _describe(syncs) -> str:
    return "\n".join(f"  {kind} at {where}" for kind, where in syncs)


def test_counter_sees_every_kind_of_host_sync():
    """On CPU, where nothing syncs, the counter still records what would sync on a device."""
    t = torch.arange(6)
    cases = {
        "item": lambda: t[0].item(), "bool": lambda: bool(t[1]), "tolist": lambda: t.tolist(),
        "mask": lambda: t[t > 2], "nonzero": lambda: t.nonzero(), "upload": lambda: torch.tensor([1, 2]),
        "repeat_interleave": lambda: torch.repeat_interleave(t, t),
    }
    for name, fn in cases.items():
        with HostSyncCounter() as counter:
            fn()
        assert len(counter.syncs) >= 1, name
    with HostSyncCounter() as counter:  # kernels that build constants or keep shapes static
        torch.full((2,), 3) + torch.arange(2) + torch.repeat_interleave(t, t, output_size=15).sum()
        torch.where(t > 2, t, 0)
    assert counter.syncs == []


@pytest.mark.parametrize("mode", list(MODES))
def test_single_device_forward_syncs_at_most_once(mode):
    torch.manual_seed(0)
    layer = MoELayer(_layer_cfg(mode), dtype=torch.float64)
    syncs = count_forward_syncs(layer, torch.randn(2, 3, 4, dtype=torch.float64))
    assert len(syncs) <= 1, f"{len(syncs)} host syncs in one MoE forward ({mode}):\n{_describe(syncs)}"


FOLD = FoldSpec(4, cp=2, tp=2, ep=2, etp=2)  # every attention and MoE dim but dp / edp in use


def _folded_syncs(rank, world_size, mode):
    torch.manual_seed(0)
    layer = MoELayer(_layer_cfg(mode, FOLD.etp, FOLD.tp), dtype=torch.float64)
    parallelize_moe(layer, cached_fold(FOLD))
    x = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    return count_forward_syncs(layer, x)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", list(MODES))
def test_folded_forward_syncs_at_most_once(worlds, mode):
    """On cp x tp x ep x etp = 2 x 2 x 2 x 2 every rank reads at most once: the block's counts."""
    for rank, syncs in enumerate(worlds(4).run(_folded_syncs, mode)):
        assert len(syncs) <= 1, f"rank {rank}: {len(syncs)} host syncs in one MoE forward ({mode}):\n{_describe(syncs)}"


def _fields_a_forward_adds(rank, world_size):
    torch.manual_seed(0)
    layer = MoELayer(_layer_cfg("sub_sequence", FOLD.etp, FOLD.tp), dtype=torch.float64)
    parallelize_moe(layer, cached_fold(FOLD))
    before = set(vars(layer.comm)) | {"experts_mesh"}  # the cached sub-mesh is built on first use
    x = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    layer(x).sum().backward()
    return sorted(set(vars(layer.comm)) - before)


@pytest.mark.multirank
def test_counts_read_reach_the_dispatch_as_arguments(worlds):
    """The counts read to cut the kept rows reach the dispatch through the permute's result, and
    the shared expert's tp sizes follow from its rows: a forward leaves nothing on the comm for
    a later call to pick up."""
    for rank, added in enumerate(worlds(4).run(_fields_a_forward_adds)):
        assert added == [], f"rank {rank}: the forward stored {added} on the layer's comm"
