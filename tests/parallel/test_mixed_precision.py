"""bf16 compute over fp32 master weights: the masters stay fp32 and keep updates below a bf16 ulp,
gradients are summed in fp32 over ranks and micro-batches (FSDP2, all-reduce, pipeline), the
router computes in fp32, and a short training run tracks the fp32 run."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.mla import MLAConfig
from meshfold.parallel.pipeline import Pipeline
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.transformer import full_state_dict, parallelize, single_device_name
from meshfold.parallel.data_parallel import reduce_gradients
from meshfold.testing.worlds import cached_fold
from meshfold.train.loop import _global_loss

pytestmark = pytest.mark.multirank

BF16, FP32 = torch.bfloat16, torch.float32


def _model(spec, seed, data_parallel, pp_schedule=None, microbatches=1, mla=False):
    """A tiny MoE transformer with fp32 master weights computing in bf16 (no balancing losses, so
    a micro-batch's gradient is exactly its token share of the whole batch's); ``mla``: its
    attention is DeepSeek-V3's MLA (with a q latent) instead of GQA with q/k norms."""
    moe = MoEConfig(hidden=16, ffn=4 * spec.etp, num_experts=8, topk=2, shared_ffn=2 * spec.tp)
    attn = dict(mla=MLAConfig(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
                ) if mla else dict(kv_heads=4, qk_norm=True)
    cfg = TransformerConfig(vocab=32, hidden=16, layers=2, heads=8, ffn=4 * spec.tp, moe=moe, first_k_dense=1,
                            **attn)
    torch.manual_seed(seed)
    model = MoETransformer(cfg)  # fp32: the master weights
    if pp_schedule is not None:
        return Pipeline(model, cached_fold(spec), microbatches, pp_schedule, data_parallel=data_parallel,
                        compute_dtype=BF16)
    return parallelize(model, cached_fold(spec), data_parallel=data_parallel, compute_dtype=BF16)


def _folded(model, spec, microbatches=1):
    """``model`` as a training step runs it: a Pipeline as it is, a model laid out whole as the
    pp = 1 Pipeline (gradient accumulation over ``microbatches``)."""
    return model if isinstance(model, Pipeline) else Pipeline.laid_out(model, cached_fold(spec), microbatches)


def _batch(spec, seed):
    g = torch.Generator().manual_seed(seed)
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    tokens = torch.randint(0, 32, (4 * spec.dp, 2 * split), generator=g)
    return tokens, torch.randint(0, 32, tokens.shape, generator=g)


def _sum_fp64(g: torch.Tensor) -> torch.Tensor:
    """The global tensor of an unreduced (Partial) gradient, its summands added in fp64."""
    local = DTensor.from_local(g.to_local().double(), g.device_mesh, g.placements, run_check=False,
                               shape=g.shape, stride=g.stride())
    return local.full_tensor()


def _named(model):
    return {single_device_name(n): p for n, p in model.named_parameters()}


def _reduced_in_fp32(rank, world_size, case):
    """Gradients of ``data_parallel`` with ``m`` micro-batches (pp: ``schedule``) against a reference
    that adds every rank's bf16-computed contribution of every micro-batch in fp64: the reference runs
    each micro-batch alone (its share of the tokens is 1/m, so its gradient is m x its contribution,
    exactly: a power-of-two scale commutes with rounding) on an all-reduce model whose Partial
    gradients are summed in fp64 here instead of by reduce_gradients."""
    spec, data_parallel, m, schedule, mla = case
    tokens, targets = _batch(spec, 3)
    b = tokens.shape[0] // spec.dp
    ref_model = _model(spec, 0, "allreduce", "gpipe" if schedule else None, mla=mla)
    ref: dict[str, torch.Tensor] = {}
    for i in range(m):  # micro-batch i: the i-th slice of every dp rank's rows
        rows = torch.cat([torch.arange(d * b + i * b // m, d * b + (i + 1) * b // m) for d in range(spec.dp)])
        _global_loss(_folded(ref_model, spec), tokens[rows], targets[rows], spec, rank, backward=True)
        for name, p in _named(ref_model).items():
            ref[name] = ref.get(name, 0) + _sum_fp64(p.grad) / m
            p.grad = None
    model = _model(spec, 0, data_parallel, schedule, m, mla)
    _global_loss(_folded(model, spec, m), tokens, targets, spec, rank, backward=True)
    reduce_gradients(model) if schedule is None else [reduce_gradients(c) for c in model.chunks]
    for name, p in _named(model).items():
        assert p.dtype == FP32 and p.grad.dtype == FP32, (name, p.dtype, p.grad.dtype)
        got, want = p.grad.full_tensor().double(), ref[name]
        # fp32 sums of a few bf16 summands are exact to ~1e-7; a bf16 sum or accumulation is off by ~4e-3
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * float(want.abs().max()),
                                   msg=lambda msg: f"{name} ({data_parallel}, m={m}): {msg}")
    return True


@pytest.mark.parametrize("spec, data_parallel, m, schedule, mla", [
    (FoldSpec(4, tp=2, ep=4), "allreduce", 1, None, False),      # dp2 x tp2 | ep4
    (FoldSpec(4, tp=2, ep=4), "fsdp", 1, None, False),           # FSDP2 with tp: tp-replicated weights' tp sums
    (FoldSpec(4, tp=2, ep=4), "fsdp", 2, None, False),
    (FoldSpec(4, tp=2, ep=4), "fsdp", 1, None, True),            # MLA's tp-replicated latent down projections
    (FoldSpec(4, cp=2, ep=2), "fsdp", 1, None, False),           # dp2 x cp2 | edp2 x ep2
    (FoldSpec(4, cp=2, ep=2), "allreduce", 2, None, False),
    (FoldSpec(4, pp=2, ep=2), "fsdp", 2, "1f1b", False),         # pp2 x dp2 | pp2 x ep2
    (FoldSpec(4, pp=2, ep=2), "allreduce", 2, "1f1b", False),
])
def test_gradients_are_summed_in_fp32_over_ranks_and_microbatches(worlds, spec, data_parallel, m, schedule, mla):
    """Every reduction and accumulation runs in fp32, including, under FSDP2 with tp > 1, the tp sums
    of tp-replicated weights (norms, q/k norms, embeddings, head, the shared expert's gate, MLA's
    latent down projections ``wq_a`` / ``wkv_a`` and latent norms), which FSDP2 would add in bf16 if
    they were all-gathered in bf16 (meshfold.parallel.transformer's docstring)."""
    assert all(worlds(4).run(_reduced_in_fp32, (spec, data_parallel, m, schedule, mla)))


def _small_update(rank, world_size, data_parallel):
    """One AdamW step whose update (lr, AdamW's first step moves each weight by about lr) is below
    half a bf16 ulp of most weights: fp32 masters take it, bf16 ones would round it away."""
    spec = FoldSpec(4, tp=2, ep=4)
    model = _model(spec, 1, data_parallel)
    masters, seen = full_state_dict(model), []

    def router_in_fp32(module, args, out):  # the gate computes with the fp32 master, not a bf16 copy
        x_TH, logits_TE = args[0], out[2]
        seen.append(logits_TE.dtype)
        torch.testing.assert_close(logits_TE, F.linear(x_TH.float(), masters["layers.1.mlp.router.weight"]),
                                   rtol=1e-6, atol=1e-6)

    model.layers[1].mlp.router.register_forward_hook(router_in_fp32)
    tokens, targets = _batch(spec, 4)
    loss = _global_loss(_folded(model, spec), tokens, targets, spec, rank, backward=True)
    reduce_gradients(model)
    assert seen == [FP32] and isinstance(loss, float)
    lr = 2.0 ** -14
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95), foreach=False)
    before = {n: p.detach().to_local().clone() for n, p in _named(model).items()}
    grads = {n: p.grad.to_local().clone() for n, p in _named(model).items()}
    opt.step()
    small = 0
    for name, p in _named(model).items():
        assert p.dtype == FP32 and all(v.dtype == FP32 for k, v in opt.state[p].items() if k != "step"), name
        w0, w1, g = before[name], p.detach().to_local(), grads[name]
        ulp = torch.finfo(BF16).eps * torch.exp2(torch.floor(torch.log2(w0.abs())))  # bf16 spacing at w0
        below = (lr < ulp / 2) & (g.abs() > 1e-6)  # a bf16 master would round these updates away
        small += int(below.sum())
        torch.testing.assert_close(w1[below] - w0[below], -lr * torch.sign(g[below]), rtol=1e-2, atol=0,
                                   msg=lambda msg: f"{name}: {msg}")
    assert small > 100, small  # the check saw enough such weights on this rank
    return True


@pytest.mark.parametrize("data_parallel", ["fsdp", "allreduce"])
def test_fp32_master_keeps_updates_below_a_bf16_ulp(worlds, data_parallel):
    assert all(worlds(4).run(_small_update, data_parallel))


# ---- a training run ---------------------------------------------------------------------------
STEPS = 30
LR = 3e-4  # AdamW moves a weight by about lr per step: below half a bf16 ulp of every |w| >= 1/8
LOSS_TOL = 0.03  # nats: the largest per-step gap to the fp32 run for bf16 + fp32 master (measured: 0.006)


def _train(rank, world_size, out_dir, dtype, master):
    from meshfold.train.config import load_config
    from meshfold.train.loop import train_rank

    sets = [f"train.steps={STEPS}", "train.batch=8", "train.seq=32", "train.eval_every=1000", "model.layers=2",
            f"train.dtype={dtype}", f"train.out_dir={json.dumps(str(out_dir))}", "train.warmup=5", f"train.lr={LR}"]
    if master:
        sets.append(f"train.master_dtype={master}")
    return train_rank(rank, world_size, load_config(None, sets).resolve())


def _train_all(rank, world_size, runs):
    for out_dir, dtype, master in runs:
        _train(rank, world_size, out_dir, dtype, master)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The default fold (tp2 x dp2 | ep4) trained 30 steps in fp32, in bf16 over fp32 masters and
    in pure bf16 (bf16 masters): {name: run folder}. In ranks of their own, as meshfold train's
    are: the session's shared world would keep the runs' process groups and freed heap (which
    other tests' peak-RSS measurements would then see)."""
    from meshfold.runtime.launch import spawn

    settings = [("fp32", "float32", None), ("mixed", "bfloat16", None), ("bf16", "bfloat16", "bfloat16")]
    out = {name: tmp_path_factory.mktemp(name) for name, _, _ in settings}
    spawn(_train_all, 4, [(out[name], dtype, master) for name, dtype, master in settings], timeout=600)
    return out


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run / "metrics.jsonl")]


@pytest.mark.slow
def test_bf16_compute_with_fp32_master_tracks_the_fp32_run(runs):
    fp32, mixed, bf16 = (_losses(runs[k]) for k in ("fp32", "mixed", "bf16"))
    assert len(fp32) == len(mixed) == len(bf16) == STEPS and fp32[-1] < fp32[0] - 0.5  # it learns
    gap = max(abs(a - b) for a, b in zip(mixed, fp32))
    assert 0 < gap < LOSS_TOL, (gap, mixed, fp32)  # > 0: it did compute in bf16
    # bf16 masters round most of these updates away and fall behind (measured: 0.37 nats over
    # the last 10 steps): the fp32 master is what keeps the run on the fp32 track
    behind = sum(b - a for a, b in zip(fp32[-10:], bf16[-10:])) / 10
    assert behind > 0.1, (behind, bf16, fp32)


def _dtypes(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
    return out


@pytest.mark.slow  # the module's trained runs (the fixture): about 40 s
def test_checkpoint_holds_fp32_masters_and_export_writes_the_compute_dtype(runs, tmp_path):
    from meshfold.cli.export import configure_export, main_export
    import argparse

    saved = _dtypes(runs["mixed"] / "checkpoints" / f"step_{STEPS:06d}")
    assert saved and set(saved.values()) == {"F32"}, {k: v for k, v in saved.items() if v != "F32"}
    parser = argparse.ArgumentParser()
    configure_export(parser)
    for args, dtype in [([], "BF16"), (["--dtype", "float32"], "F32")]:
        out = tmp_path / dtype
        main_export(parser.parse_args([str(runs["mixed"]), str(out), *args]))
        written = _dtypes(out)
        gates = {k for k in written if k.endswith("block_sparse_moe.gate.weight")}
        assert gates and {written[k] for k in gates} == {"F32"}  # routers stay in their router_dtype
        assert {v for k, v in written.items() if k not in gates} == {dtype}
