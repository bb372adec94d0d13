"""Sharded construction: a model built on the meta device and materialized shard by shard on any
fold equals, bitwise, the model built whole on one device, and no rank holds more than its shards."""

import ctypes
import dataclasses
import gc

import pytest
import torch
from hypothesis import given, settings
from torch.distributed.tensor import DTensor, Replicate, Shard
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models import init
from meshfold.parallel.pipeline import Pipeline
from meshfold.models.layers import RMSNorm
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.transformer import full_state_dict, parallelize
from meshfold.parallel.batch import shard_batch
from meshfold.parallel.materialize import materialize_shards
from meshfold.parallel.moe import place
from meshfold.parallel.plan import Plan, SequenceParallel
from meshfold.runtime.compat import fully_shard_over
from meshfold.train.sparsity import ExpertSparsity
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold

R = Replicate()


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


# ---- a user's own modules: torch's layers, norms and buffers ------------------------------------
@settings(max_examples=40)
@given(shards(), st.sampled_from([init.Init("uniform", 0.3), init.Init("normal", 1.0, zero_rows=(0, 2)),
                                  init.Init("constant", 1.0, zero_rows=(1,))]))
def test_every_kind_draws_exactly_its_part_of_the_whole(monkeypatch, case, spec):
    shape, slab, indices = case
    monkeypatch.setattr(init, "SLAB", slab)
    whole = torch.empty(shape, dtype=torch.float64)
    init.fill_(whole, spec, 5, "w", shape, [torch.arange(n) for n in shape])
    part = torch.empty([len(i) for i in indices], dtype=torch.float64)
    init.fill_(part, spec, 5, "w", shape, indices)
    assert torch.equal(part, whole[torch.meshgrid(*indices, indexing="ij")])
    assert all(not whole[r].any() for r in spec.zero_rows if r < shape[0])
    copied = init.Init("copy", data=whole)
    init.fill_(part, copied, 0, "w", shape, indices)
    assert torch.equal(part, whole[torch.meshgrid(*indices, indexing="ij")])


class OwnModel(torch.nn.Module):
    """A user's module with no meshfold declarations but one: torch's layers and norms, a buffer
    built with its values (copied) and one its ``reset_buffers`` computes (recomputed)."""

    def __init__(self, V=13, H=8, F=6):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H, padding_idx=0)  # weight [V, H]
        self.norm = torch.nn.LayerNorm(H)
        self.rms = torch.nn.RMSNorm(H)
        self.mf_norm = RMSNorm(H)  # meshfold's, declared ones
        self.up = torch.nn.Linear(H, F)  # weight [F, H], bias [F]
        self.down = torch.nn.Linear(F, H, bias=False)
        self.scale = init.normal_(torch.nn.Parameter(torch.empty(H)), std=0.5)  # declared
        g = torch.Generator().manual_seed(3)
        self.register_buffer("expert_of_token", torch.randperm(V, generator=g, device="cpu") % 4)
        self.register_buffer("inv_freq", torch.empty(H // 2))
        self.reset_buffers()

    def reset_buffers(self):
        H = 2 * self.inv_freq.shape[0]
        self.inv_freq.copy_(100.0 ** -(torch.arange(0, H, 2, device=self.inv_freq.device) / H))


def test_torch_layers_norms_and_buffers_start_as_torch_starts_them():
    model = init.build(OwnModel, seed=11, device="cpu")
    ins = model.inits
    bounds = {n: (ins[n].kind, ins[n].value) for n in ("up.weight", "up.bias", "down.weight")}
    assert bounds == {"up.weight": ("uniform", pytest.approx(8 ** -0.5)), "up.bias": ("uniform", 8 ** -0.5),
                      "down.weight": ("uniform", pytest.approx(6 ** -0.5))}
    assert ins["embed.weight"] == init.Init("normal", 1.0, zero_rows=(0,))
    assert {ins[n].value for n in ("norm.weight", "rms.weight", "mf_norm.weight")} == {1.0}
    assert ins["norm.bias"] == init.Init("constant", 0.0)
    assert ins["expert_of_token"].kind == "copy" and ins["inv_freq"].kind == "recompute"
    # torch's own distributions: torch's draws and ours fill the same interval
    big = init.build(lambda: torch.nn.Linear(64, 512), seed=0)
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 512)
    for t in (big.weight, big.bias, ref.weight, ref.bias):
        assert 0.95 * 64 ** -0.5 < t.abs().max() <= 64 ** -0.5
    assert not model.embed.weight[0].any() and model.embed.weight[1:].std() > 0.5
    g = torch.Generator().manual_seed(3)
    assert torch.equal(model.expert_of_token, torch.randperm(13, generator=g) % 4)
    assert torch.equal(model.inv_freq, 100.0 ** -(torch.arange(0, 8, 2) / 8))
    again = init.build(OwnModel, seed=11).state_dict()
    assert all(torch.equal(t, again[n]) for n, t in model.state_dict().items())


def test_a_tensor_without_a_declared_init_is_named():
    class Custom(torch.nn.Linear):
        def reset_parameters(self):  # its own initialization: meshfold cannot know it
            torch.nn.init.zeros_(self.weight)

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(2))
            self.lin = Custom(2, 2, bias=False)
            self.register_buffer("table", torch.empty(3))  # on meta, and no reset_buffers

    with pytest.raises(ValueError, match=r"\['w \(Own\)', 'lin.weight \(Custom\)', 'table \(Own\)'\] "
                                         r"declare no initialization"):
        init.build(Own, seed=0)


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


# placements over attn (dp, cp, tp) for OwnModel, laid out by hand with the public pieces or by a
# plan; the rest replicated. FSDP2 then shards every parameter further over dp x cp (13 embedding
# rows: uneven).
OWN_LAYOUT = {"embed.weight": (R, R, Shard(1)), "up.weight": (R, R, Shard(0)), "up.bias": (R, R, Shard(0)),
              "down.weight": (R, R, Shard(1))}


# the modules of tp-sharded weights get sequence parallelism (parallelize refuses a weight sharded
# over tp outside it); this model is only materialized, never run
OWN_PLAN = Plan(params=OWN_LAYOUT, default=(R, R, R), fsdp=("up",),
                tp={m: SequenceParallel() for m in ("embed", "up", "down")})


def _own_model_sharded_equals_whole(rank, world_size, specs, seed):
    whole = init.build(OwnModel, seed=seed, device="cpu").state_dict()
    for spec, how in specs:
        folded = cached_fold(spec)
        attn = folded.stage("attn")
        model = init.build(OwnModel, seed=seed, device="meta")
        if how == "plan":  # the user's route: parallelize materializes after FSDP2
            parallelize(model, folded, OWN_PLAN)
        else:  # by hand, with the public pieces
            for name, p in list(model.named_parameters()):
                module_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(module_name), attr, place(p, attn, OWN_LAYOUT.get(name, (R, R, R))))
            fully_shard_over(model, attn, ("dp", "cp"))
            materialize_shards(model, model.inits, model.init_seed, folded.device)
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)  # laid out and FSDP2-sharded: a rank holds a part
        assert sum(p.to_local().numel() for p in params) < sum(p.numel() for p in params)
        full = full_state_dict(model)
        assert full.keys() == whole.keys()
        for name, t in full.items():
            assert torch.equal(t, whole[name]), f"{spec}: {name} differs from the model built whole"
    return True


@pytest.mark.multirank
def test_own_model_built_on_meta_equals_the_whole_model_on_two_folds(worlds):
    # dp 2 x tp 2 (strided FSDP2 shards), dp 2 x cp 2; laid out by hand and by a plan
    specs = [(FoldSpec(4, tp=2), "hand"), (FoldSpec(4, cp=2), "hand"), (FoldSpec(4, tp=2), "plan")]
    assert all(worlds(4).run(_own_model_sharded_equals_whole, specs, 21))


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
