"""The shared expert runs while the dispatch all-to-all travels, and nothing else changes.

* the overlapped layer (``FoldedComm.overlap = True``, the default) computes bitwise what the
  same layer computes with the all-to-all waited at once, forward and every gradient, and what one
  device computes (fp64), on hypothesis-drawn folds of 4 ranks with a shared expert, dropless and
  dropping;
* the order of events proves the overlap: the all-to-all over ``ep`` is started with
  ``async_op=True``, the shared expert computes, then its work is waited; in backward the
  gradient's all-to-all is started before the shared expert's backward and waited after it.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig, MoELayer
from meshfold.parallel.moe import parallelize_moe
from meshfold.testing.worlds import cached_fold
from tests.parallel.test_moe_layer import _run_case, moe_cases

pytestmark = pytest.mark.multirank


def _layer_runs(rank, world_size, case):
    """(output, input grad, param grads) of the same folded layer with overlap on and off."""
    spec, cfg_kwargs, B, S, seed, _, _ = case
    cfg = MoEConfig(**cfg_kwargs)
    out = []
    for overlap in (True, False):
        torch.manual_seed(seed)
        layer = MoELayer(cfg, dtype=torch.float64)
        parallelize_moe(layer, cached_fold(spec))
        layer.comm.overlap = overlap
        g = torch.Generator().manual_seed(seed * 31 + rank)
        x = torch.randn(B // spec.dp, S // (spec.cp * spec.tp), cfg.hidden, generator=g, dtype=torch.float64)
        w = torch.randn(x.shape, generator=g, dtype=torch.float64)
        x.requires_grad_(True)
        y = layer(x)
        (y * w).sum().backward()
        out.append((y.detach(), x.grad, [p.grad.to_local() for p in layer.parameters()]))
    (ya, gxa, ga), (yb, gxb, gb) = out
    return torch.equal(ya, yb) and torch.equal(gxa, gxb) and all(map(torch.equal, ga, gb))


def _with_shared(case):
    spec, cfg, B, S, seed, steer, mode = case
    cfg = dict(cfg, shared_ffn=2 * spec.tp, shared_kind=cfg.get("shared_kind", "qwen2"))
    return spec, cfg, B, S, seed, steer, mode


@pytest.mark.parametrize("mode", ["dropless", "sub_sequence", "full_sequence"])
def test_overlapped_layer_equals_waiting_layer_and_single_device(worlds, mode):
    world = worlds(4)

    @settings(max_examples=6)
    @given(moe_cases(4, mode).map(_with_shared))
    def check(case):
        assert world.run(_layer_runs, case) == [True] * 4  # bitwise: overlap on == off
        world.run(_run_case, case)  # fp64: overlap on == one device (output, grads, losses)

    check()


class _TracedWork:
    def __init__(self, work, log, name):
        self.work, self.log, self.name = work, log, name

    def wait(self):
        self.log.append(self.name)
        return self.work.wait()


@contextlib.contextmanager
def _event_log(layer):
    """Record, in order: all-to-all calls (sync) and starts (async), waits of the started ones'
    work handles, and when the shared expert's forward and its backward begin."""
    log = []
    a2a = dist.all_to_all_single

    def traced_a2a(*args, **kwargs):
        work = a2a(*args, **kwargs)
        if not kwargs.get("async_op"):
            log.append("a2a")
            return work
        n = sum(1 for e in log if e.startswith("start")) + 1
        log.append(f"start{n}")
        return _TracedWork(work, log, f"wait{n}")

    def pre_forward(module, args):
        log.append("shared")

    def post_forward(module, args, out):  # the shared expert's last node runs first in backward
        out.grad_fn.register_prehook(lambda grads: log.append("shared_backward"))

    hooks = [layer.shared.register_forward_pre_hook(pre_forward),
             layer.shared.register_forward_hook(post_forward)]
    dist.all_to_all_single = traced_a2a
    try:
        yield log
    finally:
        dist.all_to_all_single = a2a
        for h in hooks:
            h.remove()


def _events(rank, world_size, overlap):
    cfg = MoEConfig(hidden=4, ffn=4, num_experts=4, topk=2, router_dtype=torch.float64, shared_ffn=4)
    torch.manual_seed(0)
    layer = MoELayer(cfg, dtype=torch.float64)
    parallelize_moe(layer, cached_fold(FoldSpec(world_size, tp=2, ep=2, etp=2)))
    layer.comm.overlap = overlap
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_(True)
    with _event_log(layer) as log:
        layer(x).sum().backward()
    return log


def test_shared_expert_computes_while_the_dispatch_travels(worlds):
    """Forward: start1 < shared < wait1; backward: the dispatch gradient's all-to-all start4 comes
    before the shared expert's backward and wait4 after it (2 and 3: the combine's all-to-all and
    its gradient's, each waited for at once). With overlap off, the dispatch is synchronous."""
    for log in worlds(4).run(_events, True):
        i = {e: log.index(e) for e in ("start1", "wait1", "shared", "start4", "wait4", "shared_backward")}
        assert i["start1"] < i["shared"] < i["wait1"], log
        assert i["start4"] < i["shared_backward"] < i["wait4"], log
        assert log.index("start2") + 1 == log.index("wait2") and log.index("start3") + 1 == log.index("wait3"), log
    for log in worlds(4).run(_events, False):  # synchronous: the dispatch has arrived first
        assert log.index("a2a") < log.index("shared"), log
        assert not any(e.startswith("start") for e in log[:log.index("shared")]), log

