"""Sharded construction: a model built on the meta device and materialized shard by shard on any
fold equals, bitwise, the model built whole on one device, and no rank holds more than its shards."""

import ctypes
import dataclasses
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models import init
from meshfold.parallel.pipeline import Pipeline
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.transformer import full_state_dict, parallelize
from meshfold.parallel.batch import shard_batch
from meshfold.train.sparsity import ExpertSparsity
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold


# ---- the draw itself, no ranks ----------------------------------------------------------------
@st.composite
def shards(draw):
    """A global shape, a slab size small enough to cut it into several slabs, and per-dim sorted
    index subsets (any shard a placement could produce is such an outer product)."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    slab = draw(st.sampled_from([1, 3, 8, 40, 1 << 20]))
    indices = [torch.tensor(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1))), dtype=torch.long)
               for n in shape]
    return shape, slab, indices


@settings(max_examples=60)
@given(shards(), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_a_shard_draws_exactly_its_part_of_the_whole(monkeypatch, case, dtype):
    shape, slab, indices = case
    monkeypatch.setattr(init, "SLAB", slab)
    spec, seed, name = init.Init("normal", 0.5), 123, "layers.0.attn.wq"
    whole = torch.empty(shape, dtype=dtype)
    init.fill_(whole, spec, seed, name, shape, [torch.arange(n) for n in shape])
    part = torch.empty([len(i) for i in indices], dtype=dtype)
    init.fill_(part, spec, seed, name, shape, indices)
    assert torch.equal(part, whole[torch.meshgrid(*indices, indexing="ij")])


def test_values_depend_on_seed_and_name_and_look_normal():
    shape = (64, 300)
    draws = {}
    for seed, name in [(0, "a"), (1, "a"), (0, "b")]:
        t = torch.empty(shape)
        init.fill_(t, init.Init("normal", 0.02), seed, name, shape, [torch.arange(n) for n in shape])
        draws[seed, name] = t
    assert not torch.equal(draws[0, "a"], draws[1, "a"]) and not torch.equal(draws[0, "a"], draws[0, "b"])
    assert abs(draws[0, "a"].std().item() - 0.02) < 0.001 and abs(draws[0, "a"].mean().item()) < 0.001


def test_construction_does_not_depend_on_the_dtype_or_the_global_rng():
    cfg = TransformerConfig(vocab=32, hidden=16, layers=2, heads=4, ffn=8,
                            moe=MoEConfig(hidden=16, ffn=8, num_experts=4, topk=2))
    a = MoETransformer(cfg, seed=7).state_dict()
    torch.manual_seed(99)
    b = MoETransformer(cfg, dtype=torch.float64, seed=7).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n].double(), b[n]) for n in a)
    meta = MoETransformer(cfg, device="meta", seed=7)
    assert all(p.is_meta for p in meta.parameters()) and meta.inits.keys() == a.keys()


def test_a_tensor_without_a_declared_init_is_named():
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"\['weight', 'bias'\] declare no initialization"):
        init.declared_inits(module)


# ---- folded, on 4 and 8 ranks -----------------------------------------------------------------
def _config(spec, sparse, bias):
    moe = MoEConfig(hidden=32, ffn=8 * spec.etp, num_experts=8, topk=2, router_dtype=torch.float64,
                    shared_ffn=2 * spec.tp, expert_bias=bias,
                    expert_sparsity=ExpertSparsity(tile=(4, 4)) if sparse else None)
    return TransformerConfig(vocab=48, hidden=32, layers=2 * spec.pp, heads=8, kv_heads=4, ffn=4 * spec.tp,
                             moe=moe, first_k_dense=1, qkv_bias=True, qk_norm=True)


def _build(cfg, spec, data_parallel, device=None, seed=0):
    """This rank's modules: the whole model (pp = 1) or its pipeline chunks."""
    model = MoETransformer(cfg, dtype=torch.float64, device=device, seed=seed)
    if spec.pp > 1:
        return Pipeline(model, cached_fold(spec), microbatches=spec.pp, data_parallel=data_parallel)
    return parallelize(model, cached_fold(spec), data_parallel=data_parallel)


def _sharded_equals_whole(rank, world_size, spec, sparse, bias, data_parallel, seed):
    cfg = _config(spec, sparse, bias)
    ref = MoETransformer(cfg, dtype=torch.float64, seed=seed)  # built whole, on one device
    whole = ref.state_dict()
    model = _build(cfg, spec, data_parallel, device="meta", seed=seed)
    parts = model.chunks if spec.pp > 1 else [model]
    for part in parts:
        for name, t in full_state_dict(part).items():
            assert t.device.type == "cpu" and not t.is_meta, name
            assert torch.equal(t, whole[name]), f"{name} differs from the single-device model"
    if spec.pp == 1:  # and it computes what the whole model computes (FSDP2 gathers what we drew)
        g = torch.Generator().manual_seed(seed)
        B, S = 2 * spec.dp, 4 * spec.cp * spec.tp
        tokens, targets = (torch.randint(0, cfg.vocab, (B, S), generator=g) for _ in range(2))
        local, pos = shard_batch(tokens, spec, rank)
        loss = model.loss(local, shard_batch(targets, spec, rank)[0], pos)
        torch.testing.assert_close(loss, ref.loss(tokens, targets), rtol=1e-12, atol=0)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [4, 8])
def test_sharded_construction_equals_the_single_device_model(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=6)
    @given(fold_specs(world_sizes=[world_size]).filter(lambda s: 4 % s.tp == 0 and 8 % s.ep == 0),
           st.booleans(), st.booleans(), st.sampled_from(["fsdp", "allreduce"]), st.integers(0, 10 ** 6))
    def check(spec, sparse, bias, data_parallel, seed):
        assert all(world.run(_sharded_equals_whole, spec, sparse, bias, data_parallel, seed))

    check()


# ---- memory: a >= 100M-parameter model on 4 ranks ---------------------------------------------
BIG = TransformerConfig(vocab=8192, hidden=512, layers=4, heads=8, ffn=1024,
                        moe=MoEConfig(hidden=512, ffn=1024, num_experts=16, topk=2))
ALLOWANCE = 96 << 20  # bytes: one slab in flight (4 MiB fp32), index tensors, FSDP2 and DTensor
# bookkeeping, process-group buffers and allocator slack, whatever the model's size


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _build_big(cfg, spec, whole_first):
    model = MoETransformer(cfg, device=None if whole_first else "meta", seed=1)
    if spec.pp > 1:
        return Pipeline(model, cached_fold(spec), microbatches=spec.pp)
    return parallelize(model, cached_fold(spec))


def _construction_peak(rank, world_size, spec, whole_first):
    """(bytes the peak RSS grew by while building, bytes of this rank's shards). A small model
    is built first, so code loaded and caches filled on first use are not counted."""
    _build_big(dataclasses.replace(BIG, vocab=64, hidden=64, moe=dataclasses.replace(BIG.moe, hidden=64, ffn=64)),
               spec, whole_first)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD fixed at 1 MiB: big tensors map and unmap their own pages
    gc.collect()
    libc.malloc_trim(0)  # heap freed by earlier checks in this world leaves the RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    model = _build_big(BIG, spec, whole_first)
    grown = (_status_kib("VmHWM") - before) << 10
    from torch.distributed.tensor import DTensor

    shard = sum((t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes()
                for _, t in list(model.named_parameters()) + list(model.named_buffers()))
    del model
    gc.collect()
    return grown, shard


@pytest.mark.slow
@pytest.mark.multirank
def test_construction_peak_memory_stays_within_the_ranks_own_shards(worlds):
    n_params = sum(p.numel() for p in MoETransformer(BIG, device="meta").parameters())
    assert n_params >= 100e6
    world = worlds(4)

    @settings(max_examples=3)
    @given(fold_specs(world_sizes=[4]).filter(lambda s: 8 % s.tp == 0))
    def check(spec):
        for grown, shard in world.run(_construction_peak, spec, False):
            assert shard < 4 * n_params / 2  # really sharded: well under the whole model
            assert grown <= 1.25 * shard + ALLOWANCE, (
                f"{spec}: construction grew the peak RSS by {grown / 2**20:.0f} MiB for "
                f"{shard / 2**20:.0f} MiB of shards")

    check()
    # the same measurement sees the old way, every rank building the whole model first
    grown, shard = world.run(_construction_peak, FoldSpec(4, tp=2, ep=4), True)[0]
    assert grown > 1.25 * shard + ALLOWANCE and grown >= 0.75 * 4 * n_params
