"""LivePeak counts what a device would hold: two changes no op's output shows, and wrappers.

* FSDP2 frees a gathered weight by shrinking its storage to 0 bytes and regrows the same storage
  at the next gather: the bytes leave the live count at the reshard and come back at the gather.
  (Before, a storage was counted from its first gather to the end of the step, so a dry run's
  peak held every group it had ever gathered: 660 MiB too much on Mixtral-8x22B's cp 2 / etp 2
  layer, benchmarks/RESULTS.md, "Planner against the dry run".)
* a functional collective's ``wait_tensor`` returns its input in eager execution but a new fake
  tensor under FakeTensorMode: a waited all-reduce holds its output once, as on a device (before,
  a dry run counted it twice at the root's tp all-reduce, 750 MiB on that layer).
* in eager execution a functional collective's output comes back wrapped in an
  ``AsyncCollectiveTensor`` (a wrapper subclass whose own storage has no data): the wrapper counts
  as the tensor it wraps, as a DTensor counts as its local shard.

Each check runs in a fresh spawned process on the fake backend (a process group per process).
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing

import pytest

pytestmark = pytest.mark.multirank

N = 1024  # fp32 elements: 4 KiB a tensor


def _in_fresh_process(fn):
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn).result()


def _fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)


def _waited_all_reduce() -> tuple[int, int]:
    """(peak, live at the end) of x -> all_reduce -> wait, the collective's own output dropped."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshfold.dryrun import LivePeak

    _fake_world()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), LivePeak() as peak:
            x = torch.empty(N)
            y = torch.ops._c10d_functional.all_reduce(x, "sum", dist.group.WORLD.group_name)
            z = torch.ops._c10d_functional.wait_tensor(y)
            del y
            live = peak.live
            del z, x
        return peak.peak, live
    finally:
        dist.destroy_process_group()


def test_a_waited_all_reduce_holds_its_output_once_under_fake_tensors():
    peak, live = _in_fresh_process(_waited_all_reduce)
    assert (peak, live) == (2 * 4 * N, 2 * 4 * N)  # x and the reduced tensor, as eager holds them


def _partial_to_replicate(fake: bool) -> tuple[int, int]:
    """(peak, live at the end) of x -> a DTensor partial over 2 ranks -> replicated (an all-reduce),
    eager or under FakeTensorMode: FSDP2's post-backward does this to a gradient that is partial
    over tp (tiny-mixtral on 8 ranks, tp 2, cp 2, ep 4, etp 2: the embedding's, in fp32)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from meshfold.dryrun import LivePeak

    _fake_world()
    try:
        mesh = init_device_mesh("cpu", (2,))
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), LivePeak() as peak:
            x = torch.empty(N)
            y = DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Replicate()])
            live = peak.live
            del x, y
        return peak.peak, live
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_an_all_reduced_dtensor_holds_its_output_once(fake):
    """Eager, the functional all-reduce's output comes back wrapped in an AsyncCollectiveTensor,
    whose own storage holds no bytes: the reduced tensor counts once, as under fake tensors."""
    peak, live = _in_fresh_process(functools.partial(_partial_to_replicate, fake))
    assert (peak, live) == (2 * 4 * N, 2 * 4 * N)  # x and the reduced tensor


def _gather_and_reshard() -> tuple[int, int, int]:
    """Live bytes before a gather of an FSDP2 module, while gathered, and after its reshard."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshfold.dryrun import LivePeak

    _fake_world()
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        live = []
        with LivePeak(exclude=list(model.parameters())) as peak:
            for _ in range(2):  # the second gather regrows the storage the first one made
                live.append(peak.live)
                model[0].unshard()
                live.append(peak.live)
                model[0].reshard()
            live.append(peak.live)
        return tuple(live)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_an_fsdp2_reshard_frees_the_gathered_weight_and_the_next_gather_counts_it_again():
    before, gathered, after, again, final = _in_fresh_process(_gather_and_reshard)
    assert gathered - before >= 32 * 32 * 4  # the whole weight, fp32
    assert after == before
    assert again == gathered
    assert final == before
