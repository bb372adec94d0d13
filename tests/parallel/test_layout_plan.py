"""A model meshfold does not ship, with its own module and parameter names, laid out through a
Plan alone: loss and every gradient equal one device (fp64) on folds covering tp, cp, etp, ep,
dp and edp, with FSDP2 and full recompute; bf16 compute over fp32 masters runs and stays close.
And nothing silent: every rule that does not fit the model is an error naming it."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshfold.kernels import grouped_mm
from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig, MoELayer
from meshfold.models.attention import attend
from meshfold.models.transformer import MoETransformer, TransformerConfig, cross_entropy_sum
from meshfold.parallel.batch import shard_batch
from meshfold.parallel.data_parallel import reduce_gradients
from meshfold.parallel.pipeline import ModelChunk, Pipeline
from meshfold.parallel.plan import (Plan, SequenceParallel, VocabParallel, check_plan, matches, model_plan,
                                    register_plan, restrict)
from meshfold.parallel.recompute import apply_recompute
from meshfold.parallel.transformer import full_state_dict, param_layouts, parallelize, single_device_name
from meshfold.parallel.transformer_plan import transformer_plan
from meshfold.testing.worlds import cached_fold

R = Replicate()
H, HEADS, E, FFN, VOCAB = 8, 4, 4, 4, 16


class Norm(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))

    def forward(self, x):
        x32 = x.float() if x.dtype == torch.bfloat16 else x  # statistics in fp32 under bf16 compute
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.scale


class Mixer(nn.Module):
    """Causal attention without RoPE; ``context`` is the context-parallel hook."""

    def __init__(self, dtype):
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.proj = (nn.Parameter(torch.randn(H, H, dtype=dtype) * H ** -0.5)
                                                      for _ in range(4))
        self.context = None

    def forward(self, x, positions):
        B, S, _ = x.shape
        q, k, v = ((x @ w).view(B, S, -1, H // HEADS).transpose(1, 2) for w in (self.to_q, self.to_k, self.to_v))
        o = attend(q, k, v) if self.context is None else self.context(q, k, v, positions)
        return o.transpose(1, 2).reshape(B, S, -1) @ self.proj


class SquaredReLUExperts(nn.Module):
    """``relu(x @ w_in)^2 @ w_out`` per expert (the expert call signature of MoELayer)."""

    def __init__(self, dtype):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(E, H, FFN, dtype=dtype) * H ** -0.5)
        self.w_out = nn.Parameter(torch.randn(E, FFN, H, dtype=dtype) * FFN ** -0.5)

    def forward(self, x_MH, offsets_E, local, local_mask=None):
        h = grouped_mm(x_MH, local("experts.w_in", self.w_in), offsets_E)
        return grouped_mm(F.relu(h).square(), local("experts.w_out", self.w_out), offsets_E)


class ParallelBlock(nn.Module):
    """``x + mixer(ln(x)) + ffn(ln(x))``: attention and MoE in parallel from one shared norm."""

    def __init__(self, dtype, router_dtype):
        super().__init__()
        self.ln = Norm(dtype)
        self.mixer = Mixer(dtype)
        self.ffn = MoELayer(MoEConfig(hidden=H, ffn=FFN, num_experts=E, topk=2, router_dtype=router_dtype,
                                      global_aux_loss_coeff=0.01), dtype=dtype)
        self.ffn.experts = SquaredReLUExperts(dtype)

    def forward(self, x, positions):
        h = self.ln(x)
        return x + self.mixer(h, positions) + self.ffn(h)


class TinyLM(nn.Module):
    reduce_loss = None  # set by parallelize: (loss sum, count) -> the global mean
    gather_logits = None

    def __init__(self, dtype=torch.float64, router_dtype=torch.float64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, H, dtype=dtype)
        self.blocks = nn.ModuleList(ParallelBlock(dtype, router_dtype) for _ in range(2))
        self.final = Norm(dtype)
        self.unembed = nn.Linear(H, VOCAB, bias=False, dtype=dtype)

    def loss(self, tokens, targets, positions=None):
        x = self.tok(tokens)
        pos = torch.arange(tokens.shape[1]) if positions is None else positions
        for block in self.blocks:
            x = block(x, pos)
        total, count = self.loss_terms(self.unembed(self.final(x)), targets)
        return total / count if self.reduce_loss is None else self.reduce_loss(total, count)

    def loss_terms(self, logits, targets):  # what a pipeline's last stage computes
        return cross_entropy_sum(logits, targets)


MOE = {"router.weight": ("attn", (R, R, R)),
       "experts.w_in": ("moe", (R, Shard(0), Shard(2))),  # experts over ep, ffn over etp
       "experts.w_out": ("moe", (R, Shard(0), Shard(1)))}
PLAN = Plan(
    params={"blocks.*.mixer.to_[qkv]": (R, R, Shard(1)), "blocks.*.mixer.proj": (R, R, Shard(0)),
            "**.scale": (R, R, R), "tok.weight": (R, R, R), "unembed.weight": (R, R, R)},
    tp={"blocks.*.mixer": SequenceParallel(positions=True)},
    context={"blocks.*.mixer": "ring"},
    moe={"blocks.*.ffn": MOE},
    fsdp=("blocks.*.ffn.experts", "blocks.*"),
    tp_summed=("blocks.*.ln",),
    recompute=("blocks.*",),
    keep_dtype={"blocks.*.ffn.router.weight": None},
    blocks="blocks", before=("tok",), after=("final", "unembed"),
)


# ---- one device ---------------------------------------------------------------------------------

def _moe_calls(model):
    calls = []
    for block in model.blocks:
        block.ffn.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_recompute_wraps_a_custom_block():
    """A block that is not meshfold's recomputes (2 MoE forwards, 2 more in backward) and its
    gradients are bitwise those without recompute; "none" restores its own forward."""
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in ("none", "full", "selective"):
        model = TinyLM()
        apply_recompute(model.blocks, mode)
        calls = _moe_calls(model)
        model.loss(tokens, tokens).backward()
        assert len(calls) == (2 if mode == "none" else 4), (mode, len(calls))
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in TinyLM().named_parameters()]
    for mode in ("full", "selective"):
        assert all(torch.equal(grads[mode][n], g) for n, g in grads["none"].items()), mode
    apply_recompute(model.blocks, "none")
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_plan_patterns_match_whole_segments():
    assert matches("blocks.*", "blocks.0") and not matches("blocks.*", "blocks.0.ffn")
    assert matches("**.scale", "final.scale") and matches("**.scale", "blocks.1.ln.scale")
    assert matches("blocks.*.mixer.to_[qkv]", "blocks.0.mixer.to_k") and not matches("blocks.*.mixer.to_[qkv]",
                                                                                    "blocks.0.mixer.proj")


@pytest.mark.parametrize("change, error", [
    (dict(params={k: v for k, v in PLAN.params.items() if k != "unembed.weight"}),
     "parameter 'unembed.weight' matches no Plan.params entry"),
    (dict(params={**PLAN.params, "blocks.*.mixer.wq": (R, R, Shard(1))}),
     "Plan.params pattern 'blocks.\\*.mixer.wq' matches no parameter"),
    (dict(tp={"blocks.*.attn": SequenceParallel()}), "Plan.tp pattern 'blocks.\\*.attn' matches none"),
    (dict(context={"blocks.*.ln": "ring"}), "'blocks.0.ln' \\(Norm\\), which has no 'context' hook"),
    (dict(moe={"layers.*.mlp": MOE}), "Plan.moe pattern 'layers.\\*.mlp' matches none"),
    (dict(moe={"blocks.*.mixer": MOE}), "Plan.moe pattern .blocks.\\*.mixer. matches .blocks.0.mixer., a \\w+ that is not an MoE layer"),
    (dict(fsdp=("blocks.*.mlp",)), "Plan.fsdp pattern 'blocks.\\*.mlp' matches none"),
    (dict(tp_summed=("blocks.*.norm",)), "Plan.tp_summed pattern 'blocks.\\*.norm' matches none"),
    (dict(recompute=("layers.*",)), "Plan.recompute pattern 'layers.\\*' matches none"),
    (dict(keep_dtype={"blocks.*.router.weight": None}), "Plan.keep_dtype pattern 'blocks.\\*.router.weight'"),
    (dict(blocks="tok"), "Plan.blocks = 'tok' is Embedding"),
])
def test_a_plan_that_does_not_fit_is_an_error_naming_it(change, error):
    fields = {f: getattr(PLAN, f) for f in PLAN.__dataclass_fields__} | change
    with pytest.raises(ValueError, match=error):
        check_plan(TinyLM(), Plan(**fields))


def test_a_default_places_what_no_entry_names():
    check_plan(TinyLM(), Plan(params={}, default=(R, R, R), moe={"blocks.*.ffn": MOE}))
    with pytest.raises(ValueError, match="parameter 'tok.weight' matches no Plan.params entry"):
        check_plan(TinyLM(), Plan(params={}, moe={"blocks.*.ffn": MOE}))


def test_a_model_without_a_plan_is_an_error():
    with pytest.raises(ValueError, match="TinyLM declares no layout plan"):
        parallelize(TinyLM(), None)


def test_a_registered_plan_is_the_default_of_its_class_and_subclasses():
    class Registered(TinyLM):
        pass

    class Derived(Registered):
        pass

    register_plan(Registered, lambda model: dataclasses.replace(PLAN, whole=True))
    assert model_plan(Derived()).whole and model_plan(Registered()).params == PLAN.params
    with pytest.raises(ValueError, match="TinyLM declares no layout plan"):
        model_plan(TinyLM())  # a base class gets nothing from its subclass's plan


_TINY_CFG = TransformerConfig(vocab=16, hidden=8, layers=2, heads=2, kv_heads=2, ffn=8)


@pytest.mark.parametrize("make", [lambda: (TinyLM(), dataclasses.replace(PLAN, whole=True)),
                                  lambda: (MoETransformer(_TINY_CFG), None)], ids=["user plan", "MoETransformer"])
def test_a_whole_model_plan_is_refused_with_pp_above_one(make):
    """The refusal follows the plan's ``whole``, the same for a user's model and meshfold's, and
    comes before any mesh is touched (the fold here has only a spec)."""
    model, plan = make()
    with pytest.raises(ValueError, match=f"pp = 2: the plan lays out the whole {type(model).__name__}"):
        parallelize(model, SimpleNamespace(spec=FoldSpec(2, pp=2)), plan)


def test_a_pipeline_chunk_plan_is_not_whole():
    chunk = ModelChunk(TinyLM(), [0], first=True, last=False, plan=dataclasses.replace(PLAN, whole=True))
    assert not chunk.plan().whole and not restrict(PLAN, TinyLM()).whole
    assert transformer_plan(_TINY_CFG).whole and not transformer_plan(_TINY_CFG, layers=[0]).whole


# ---- folded: 4 ranks ------------------------------------------------------------------------------

def _batch(spec, seed=1):
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (2 * spec.dp, 2 * split), generator=g),
            torch.randint(0, VOCAB, (2 * spec.dp, 2 * split), generator=g))


def _folded(rank, spec, compute_dtype, recompute, data_parallel):
    folded = cached_fold(spec)
    master = torch.float64 if compute_dtype is None else torch.float32
    model = TinyLM(master, router_dtype=master)
    layouts = param_layouts(model, folded, PLAN)
    model = parallelize(model, folded, PLAN, data_parallel=data_parallel, compute_dtype=compute_dtype,
                        recompute=recompute)
    calls = _moe_calls(model)
    tokens, targets = _batch(spec)
    local, pos = shard_batch(tokens, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    loss = model.loss(local, local_targets, pos)
    loss.backward()
    if data_parallel == "allreduce":  # the Partial gradients' summands added in fp64: the reference sum
        grads = {single_device_name(n): DTensor.from_local(p.grad.to_local().double(), p.device_mesh,
                                                           p.grad.placements, run_check=False).full_tensor()
                 for n, p in model.named_parameters()}
    else:
        grads = {single_device_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    return model, layouts, loss.detach(), grads, len(calls)


def _run(rank, world_size, spec):
    ref = TinyLM()
    tokens, targets = _batch(spec)
    ref_loss = ref.loss(tokens, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model, layouts, loss, grads, calls = _folded(rank, spec, None, "full", "fsdp")
    # the experts are laid out on the MoE mesh as the plan's table says, not replicated on attn
    moe, attn = cached_fold(spec).stage("moe"), cached_fold(spec).stage("attn")
    assert layouts["blocks.1.ffn.experts.w_in"] == (moe, (R, Shard(0), Shard(2)))
    assert layouts["blocks.0.mixer.proj"] == (attn, (R, R, Shard(0)))
    assert calls == 4  # two MoE layers, each recomputed in backward
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():  # summed, not averaged, over dp / edp
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    full = full_state_dict(model)  # single-device names: a checkpoint loads into the plain model
    assert {n: t.shape for n, t in full.items()} == {n: t.shape for n, t in ref.state_dict().items()}
    for name, t in TinyLM().state_dict().items():
        assert torch.equal(full[name], t), name

    # an FSDP2 group over attention and expert weights at once is an error naming both
    fields = {f: getattr(PLAN, f) for f in PLAN.__dataclass_fields__} | dict(fsdp=("blocks.*",))
    with pytest.raises(ValueError, match=r"FSDP2 group 'blocks.0' holds parameters on different meshes "
                                         r"\('blocks.0.\S+' on \('dp', 'cp', 'tp'\), 'blocks.0.ffn.experts.w_\w+' "
                                         r"on \('edp', 'ep', 'etp'\)\)"):
        parallelize(TinyLM(), cached_fold(spec), Plan(**fields))

    # bf16 compute over fp32 masters, the routers kept in fp32: FSDP2 (its policies per group, the
    # tp-summed norm gathered in fp32) sums each rank's bf16-computed gradient in fp32, as an fp64
    # sum of the same summands does; a bf16 sum would be off by ~4e-3
    _, _, loss16, grads16, _ = _folded(rank, spec, torch.bfloat16, "none", "fsdp")
    _, _, ref16, want16, _ = _folded(rank, spec, torch.bfloat16, "none", "allreduce")
    torch.testing.assert_close(loss16, ref16, rtol=0, atol=0)
    torch.testing.assert_close(loss16.double(), ref_loss.detach(), rtol=5e-2, atol=0)  # bf16: near fp64
    for name, g in want16.items():
        assert grads16[name].dtype == torch.float32, name
        torch.testing.assert_close(grads16[name].double(), g, rtol=2e-6, atol=2e-6 * float(g.abs().max()),
                                   msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("spec", [
    FoldSpec(4, tp=2, cp=2, ep=2, etp=2),  # tp2 x cp2 | ep2 x etp2: sequence parallel, the ring, expert tp
    FoldSpec(4, dp=2, tp=2, ep=2),         # dp2 x tp2 | edp2 x ep2: FSDP2 sums over dp and edp
], ids=["tp2cp2-ep2etp2", "dp2tp2-edp2ep2"])
def test_custom_model_through_a_plan_equals_one_device(worlds, spec):
    assert all(worlds(4).run(_run, spec))


def _run_pipeline(rank, world_size, spec, microbatches):
    """pp2: the chunks hold the user's blocks under their own names; loss and gradients equal one
    device with gradient accumulation over the same microbatches (dp = 1: microbatch j is rows j)."""
    tokens, targets = _batch(spec)
    ref = TinyLM()
    for block in ref.blocks:
        block.ffn.balancing_scale = 1 / microbatches
    ref_loss = 0.0
    for rows in torch.arange(tokens.shape[0]).chunk(microbatches):
        loss = ref.loss(tokens[rows], targets[rows]) / microbatches
        loss.backward()
        ref_loss += loss.item()
    pipe = Pipeline(TinyLM(), cached_fold(spec), microbatches, "1f1b", recompute="full", plan=PLAN)
    local, pos = shard_batch(tokens, spec, rank)
    loss = pipe.step(local, shard_batch(targets, spec, rank)[0], pos)
    torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-12, atol=1e-12)
    names = set()
    for name, p in pipe.named_parameters():
        name = single_device_name(name)
        names.add(name)
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad, rtol=1e-10,
                                   atol=1e-12, msg=lambda m: f"{name}: {m}")
    stage = spec.coords(rank)["attn"]["pp"]
    assert {n.split(".")[0] for n in names} == ({"tok", "blocks"} if stage == 0 else {"blocks", "final", "unembed"})
    assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {str(stage)}
    return True


@pytest.mark.multirank
def test_custom_model_pipeline_equals_one_device(worlds):
    assert all(worlds(4).run(_run_pipeline, FoldSpec(4, pp=2, tp=2, ep=2), 2))


def test_single_device_names_keep_a_users_own_names():
    """Only the parametrization's ``parametrizations.<attr>.original`` is undone: a module of the
    user's called ``inner`` or ``original`` keeps its name in checkpoints."""
    assert single_device_name("blocks.0.mixer.parametrizations.to_q.original") == "blocks.0.mixer.to_q"
    assert single_device_name("parametrizations.w.original") == "w"
    assert single_device_name("enc.inner.original.w") == "enc.inner.original.w"


# ---- checkpoints: saved on one fold, loaded on another and on one device ----------------------------

def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _trained_state(model, optimizer):
    """{single-device name: full tensor} of the parameters and their AdamW moments (collective)."""
    out = {}
    for n, p in model.named_parameters():
        out[single_device_name(n)] = _full(p.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{single_device_name(n)}.{key}"] = _full(optimizer.state[p][key])
    return out


def _save_on_one_fold_load_on_another(rank, world_size, path):
    from meshfold.train import checkpoint

    a, b = FoldSpec(4, tp=2, cp=2, ep=2, etp=2), FoldSpec(4, dp=2, tp=2, ep=2)
    model = parallelize(TinyLM(), cached_fold(a), PLAN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tokens, targets = _batch(a)
    local, pos = shard_batch(tokens, a, rank)
    model.loss(local, shard_batch(targets, a, rank)[0], pos).backward()
    optimizer.step()
    saved = _trained_state(model, optimizer)
    checkpoint.save(path, 1, model, optimizer, {"step": 1})
    other = parallelize(TinyLM(seed=5), cached_fold(b), PLAN)  # other weights, another fold
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2, foreach=False)
    assert checkpoint.load(f"{path}/step_000001", other, other_optimizer, restore_rng=False)["step"] == 1
    loaded = _trained_state(other, other_optimizer)
    assert loaded.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name
    return {single_device_name(n): saved[single_device_name(n)] for n, _ in model.named_parameters()}


@pytest.mark.multirank
def test_a_checkpoint_of_a_custom_model_loads_on_another_fold_and_on_one_device(worlds, tmp_path):
    """A user model laid out by its plan, after an AdamW step on tp2 x cp2 | ep2 x etp2, saved under
    its own single-device names: loaded on dp2 x tp2 | edp2 x ep2 every parameter and moment is
    bitwise what was saved, and the plain single-device model loads it too."""
    from meshfold.train import checkpoint

    saved = worlds(4).run(_save_on_one_fold_load_on_another, str(tmp_path))[0]
    plain = TinyLM(seed=7)
    checkpoint.load(tmp_path / "step_000001", plain, restore_rng=False)
    state = dict(plain.named_parameters())
    assert state.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(state[name].detach(), t), name


# ---- vocabulary parallelism: the embedding and the head sharded over tp along V ---------------------

VOCAB_PLAN = Plan(**{f: getattr(PLAN, f) for f in PLAN.__dataclass_fields__} | dict(
    params={**PLAN.params, "tok.weight": (R, R, Shard(0)), "unembed.weight": (R, R, Shard(0))},
    tp={**PLAN.tp, "tok": VocabParallel("embedding"), "unembed": VocabParallel("head")}))


def _vocab_parallel(rank, world_size, spec):
    ref = TinyLM()
    tokens, targets = _batch(spec)
    ref_loss = ref.loss(tokens, targets)
    ref_loss.backward()
    model = parallelize(TinyLM(), cached_fold(spec), VOCAB_PLAN, recompute="full")
    assert model.tok.parametrizations["weight"].original.to_local().shape[0] <= VOCAB // spec.tp  # V / tp rows or fewer (FSDP2)
    local, pos = shard_batch(tokens, spec, rank)
    loss = model.loss(local, shard_batch(targets, spec, rank)[0], pos)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    for n, p in model.named_parameters():
        want = ref.get_parameter(single_device_name(n)).grad
        torch.testing.assert_close(p.grad.full_tensor(), want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")
    # the weight must be laid out over the vocabulary, or the style is an error naming it
    wrong = Plan(**{f: getattr(VOCAB_PLAN, f) for f in PLAN.__dataclass_fields__} | dict(
        params={**VOCAB_PLAN.params, "unembed.weight": (R, R, R)}))
    with pytest.raises(ValueError, match=r"vocabulary-parallel Linear: its weight must be laid out Shard\(0\) over tp"):
        parallelize(TinyLM(), cached_fold(spec), wrong)
    return True


@pytest.mark.multirank
def test_vocabulary_parallel_embedding_and_head_equal_one_device(worlds):
    """tp2 x cp2 | ep2 x etp2 with the embedding and the head sharded over tp along the
    vocabulary (FSDP2, full recompute): loss and every gradient equal one device in fp64."""
    assert all(worlds(4).run(_vocab_parallel, FoldSpec(4, tp=2, cp=2, ep=2, etp=2)))
