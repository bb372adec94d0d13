"""DeepSeek-V3 (MLA, YaRN, sigmoid group-limited routing with the correction bias, shared experts,
dense first layers) against transformers' ``DeepseekV3ForCausalLM``, and on folded layouts.

Shapes are odd on purpose: 6 heads, latent ranks 20 and 12 (not powers of two), 3 expert groups
of 2, top-3 of 2 groups (so ``top-k / topk_group`` = 1 differs from the 2 experts transformers
sums per group score), mscale != mscale_all_dim (the YaRN rope factor is not 1).
"""

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from meshfold.interop.hf import from_pretrained, load_state, save_pretrained

TOL32 = dict(rtol=0, atol=1e-4)  # the bound on logits, fp32


def hf_config(**kw) -> DeepseekV3Config:
    base = dict(vocab_size=96, hidden_size=48, intermediate_size=40, moe_intermediate_size=14,
                num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=6, n_routed_experts=6,
                n_group=3, topk_group=2, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
                routed_scaling_factor=1.7, norm_topk_prob=True, q_lora_rank=20, kv_lora_rank=12,
                qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10, max_position_embeddings=128,
                rope_interleave=True, rms_norm_eps=1e-5,
                rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=4.0,
                                     original_max_position_embeddings=32, beta_fast=8.0, beta_slow=1.0,
                                     mscale=0.9, mscale_all_dim=0.7),
                attn_implementation="eager", experts_implementation="eager")
    base.update(kw)
    return DeepseekV3Config(**base)


def random_hf_model(cfg: DeepseekV3Config, seed: int) -> DeepseekV3ForCausalLM:
    """An HF model with weights of unit-scale activations (the default 0.02 init makes logits
    nearly uniform), norms away from 1 and a non-zero correction bias, so every path matters."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def hf_checkpoint(tmp_path, seed=0, **kw):
    hf = random_hf_model(hf_config(**kw), seed)
    hf.save_pretrained(tmp_path)
    return hf


def tokens(vocab, B=2, S=24, seed=1):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


VARIANTS = {
    "q-latent-yarn-interleaved": {},
    "plain-q-default-rope-no-renorm": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False,
                                           rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    "yarn-without-mscale": dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=8.0,
                                                     original_max_position_embeddings=16)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers_single_device(tmp_path, variant):
    hf = hf_checkpoint(tmp_path, **VARIANTS[variant])
    ours = from_pretrained(tmp_path, dtype=torch.float32)
    t = tokens(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(t).logits
        got = ours(t)
    assert expected.abs().max() > 1  # not near-uniform: the comparison has teeth
    torch.testing.assert_close(got, expected, **TOL32)


def test_router_matches_transformers_group_scoring():
    """meshfold's Router on HF's gate weights and correction bias picks the same experts with the
    same weights, on a config where HF's group score (best 2) differs from top-k / topk_group."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from meshfold.interop.hf_deepseek import config_from_hf
    from meshfold.models.router import Router

    cfg = hf_config(n_routed_experts=12, n_group=3, topk_group=2, num_experts_per_tok=2)
    torch.manual_seed(0)
    theirs = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.normal_(std=0.5)
    ours = Router(config_from_hf(cfg.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}).moe)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, cfg.hidden_size)
    _, w_hf, e_hf = theirs(x)
    w, e, _ = ours(x)
    order_hf, order = e_hf.argsort(-1), e.argsort(-1)
    torch.testing.assert_close(e.gather(1, order), e_hf.gather(1, order_hf), rtol=0, atol=0)
    torch.testing.assert_close(w.gather(1, order), w_hf.gather(1, order_hf), rtol=1e-6, atol=1e-7)


def test_save_load_round_trip_is_exact_and_transformers_reads_it(tmp_path):
    hf = hf_checkpoint(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf", dtype=torch.float32)
    save_pretrained(ours, tmp_path / "out")
    again = from_pretrained(tmp_path / "out", dtype=torch.float32)
    a, b = ours.state_dict(), again.state_dict()
    assert set(a) == set(b) and any(k.endswith("router.expert_bias") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    theirs = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                   experts_implementation="eager").eval()
    t = tokens(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(theirs(t).logits, hf(t).logits, rtol=0, atol=1e-5)


def test_checkpoint_that_does_not_fit_names_tensor_and_both_shapes(tmp_path):
    hf_checkpoint(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["kv_lora_rank"] = 16  # the checkpoint's kv latent is 12
    (tmp_path / "config.json").write_text(json.dumps(hf))
    from meshfold.interop.hf import config_from_hf

    # the first misfit in parameter order: MLA's own parameters come before its submodules
    # (the down projections, LatentProjection), so kv_b_proj is met before kv_a_proj_with_mqa
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.kv_b_proj\.weight' has shape "
                                         r"\[96, 12\] but the config expects \[96, 16\]"):
        load_state(tmp_path, config_from_hf(hf))


# ----------------------------------------------------------------------------- folded layouts

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from meshfold.mesh import FoldSpec  # noqa: E402
from meshfold.testing.strategies import fold_specs  # noqa: E402
from meshfold.testing.worlds import cached_fold  # noqa: E402
from meshfold.testing.references import checkpoint_reads  # noqa: E402

TOL64 = dict(rtol=1e-9, atol=1e-11)


def _folded_config(layers=2, aux=0.0, q_latent=True):
    """Every DeepSeek-V3 feature at sizes that divide tp, etp <= 4, ep <= 8: 4 heads, latents of
    12 (or a plain q projection) / 10, YaRN with mscale, 8 experts in 4 groups (top-3 of 2
    groups), a shared expert."""
    from meshfold.models.config import MoEConfig
    from meshfold.models.mla import MLAConfig, YaRN
    from meshfold.models.transformer import TransformerConfig

    moe = MoEConfig(hidden=16, ffn=4, num_experts=8, topk=3, score_function="sigmoid", renormalize=True,
                    topk_scaling_factor=2.5, num_groups=4, group_topk=2, group_score_topk=2, expert_bias=True,
                    shared_ffn=8, shared_kind="deepseek", router_dtype=torch.float64, seq_aux_loss_coeff=aux)
    mla = MLAConfig(q_lora_rank=12 if q_latent else None, kv_lora_rank=10, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                    yarn=YaRN(factor=4.0, original_max_seq=8, beta_fast=8.0, mscale=0.9, mscale_all_dim=0.7))
    return TransformerConfig(vocab=32, hidden=16, layers=layers, heads=4, ffn=8, moe=moe, first_k_dense=1,
                             mla=mla, max_seq=64)


def _reference(cfg, seed):
    from meshfold.models.transformer import MoETransformer

    torch.manual_seed(seed)
    ref = MoETransformer(cfg, dtype=torch.float64)
    with torch.no_grad():  # norms away from 1 and a correction bias that changes the routing
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in ref.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return ref


def _run_folded(rank, world_size, case):
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize, single_device_name
    from meshfold.parallel.data_parallel import reduce_gradients
    from meshfold.parallel.batch import shard_batch

    spec, B, S, seed, data_parallel, aux, q_latent = case
    cfg = _folded_config(aux=aux, q_latent=q_latent)
    ref = _reference(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens_, targets = (torch.randint(0, cfg.vocab, (B, S), generator=g) for _ in range(2))
    model = MoETransformer(cfg, dtype=torch.float64)
    model.load_state_dict(ref.state_dict())  # the reference's weights and correction bias
    parallelize(model, cached_fold(spec), data_parallel=data_parallel)
    ref_loss = ref.loss(tokens_, targets)
    ref_loss.backward()
    local_tokens, pos = shard_batch(tokens_, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    loss = model.loss(local_tokens, local_targets, pos)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL64)
    reduce_gradients(model)
    got = {single_device_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(got) == set(ref_grads)
    for name, grad in got.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL64, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(model(local_tokens, pos).full_tensor(), ref(tokens_), **TOL64)
    return True


@st.composite
def folded_cases(draw, world_size):
    spec = draw(fold_specs(world_sizes=[world_size], pp=[1]).filter(lambda s: 4 % s.tp == 0 and 4 % s.etp == 0))
    B = spec.dp * draw(st.integers(1, 2))
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    S = split * draw(st.integers(1, 2))
    return (spec, B, S, draw(st.integers(0, 10**6)), draw(st.sampled_from(["fsdp", "allreduce"])),
            draw(st.sampled_from([0.0, 0.01])), draw(st.booleans()))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_folded_loss_and_grads_equal_single_device(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=5 if world_size == 4 else 4)
    @given(folded_cases(world_size))
    def check(case):
        assert all(world.run(_run_folded, case))

    check()


@pytest.mark.multirank
@pytest.mark.parametrize("spec", [
    FoldSpec(4, cp=2, tp=2, ep=2, etp=2),          # cp2 x tp2 | ep2 x etp2
    FoldSpec(8, dp=2, cp=2, tp=2, ep=2, etp=2),    # dp2 x cp2 x tp2 | edp2 x ep2 x etp2: every dim
])
def test_named_folds_every_dim(worlds, spec):
    B, S = 2 * spec.dp, 4 * spec.cp * spec.tp
    assert all(worlds(spec.world_size).run(_run_folded, (spec, B, S, 3, "fsdp", 0.01, True)))


def _run_pipeline(rank, world_size, spec, seed):
    from meshfold.parallel.pipeline import Pipeline
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import single_device_name
    from meshfold.parallel.batch import shard_batch

    cfg = _folded_config(layers=4)
    ref = _reference(cfg, seed)
    B, S, microbatches = 2 * spec.dp, 4 * spec.cp * spec.tp, 2
    g = torch.Generator().manual_seed(seed + 1)
    tokens_, targets = (torch.randint(0, cfg.vocab, (B, S), generator=g) for _ in range(2))
    b = B // spec.dp
    mb = b // microbatches
    ref_total = 0.0
    for j in range(microbatches):  # microbatch j: every dp rank's j-th slice of its rows
        rows = torch.cat([torch.arange(d * b + j * mb, d * b + (j + 1) * mb) for d in range(spec.dp)])
        loss = ref.loss(tokens_[rows], targets[rows]) * (rows.numel() / B)
        loss.backward()
        ref_total += loss.item()
    model = MoETransformer(cfg, dtype=torch.float64)
    model.load_state_dict(ref.state_dict())
    pipe = Pipeline(model, cached_fold(spec), microbatches, "1f1b", 1, "fsdp")
    local_tokens, pos = shard_batch(tokens_, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    torch.testing.assert_close(pipe.step(local_tokens, local_targets, pos).item(), ref_total, **TOL64)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in pipe.named_parameters():
        name = single_device_name(name)
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], **TOL64, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.multirank
def test_pipeline_fold_equals_single_device(worlds):
    spec = FoldSpec(4, pp=2, tp=2, ep=2)  # pp2 x tp2 | ep2
    assert all(worlds(4).run(_run_pipeline, spec, 5))


def _load_folded(rank, world_size, path, spec, expected):
    import math

    from meshfold.parallel.moe import local_slices
    from meshfold.parallel.transformer import full_state_dict, param_layouts
    from meshfold.parallel.batch import shard_batch

    with checkpoint_reads() as read:
        folded = from_pretrained(path, mesh=cached_fold(spec), dtype=torch.float32)
    single = from_pretrained(path, dtype=torch.float32)
    shards = [local_slices(p.shape, mesh, placements)
              for (mesh, placements), p in zip(param_layouts(single, cached_fold(spec)).values(), single.parameters())]
    biases = sum(b.numel() for n, b in single.named_buffers() if n.endswith("expert_bias"))  # read whole
    assert sum(read) == sum(math.prod(s.stop - s.start for s in sl) for sl in shards) + biases
    local, pos = shard_batch(tokens(single.cfg.vocab), spec, rank)
    with torch.no_grad():
        torch.testing.assert_close(folded(local, pos).full_tensor(), expected, **TOL32)
    full = full_state_dict(folded)
    for name, t in single.state_dict().items():
        torch.testing.assert_close(full[name], t, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.multirank
def test_folded_load_reads_own_slices_and_logits_equal_transformers(worlds, tmp_path):
    """6 heads over tp 2, 6 experts over ep 2, expert ffn 14 over etp 2, sequence over cp 2."""
    hf = hf_checkpoint(tmp_path)
    with torch.no_grad():
        expected = hf(tokens(hf.config.vocab_size)).logits
    spec = FoldSpec(4, cp=2, tp=2, ep=2, etp=2)
    assert all(worlds(4).run(_load_folded, str(tmp_path), spec, expected))


@pytest.mark.parametrize("fold, message", [
    (dict(world_size=8, tp=8), "heads = 4 is not divisible by tp = 8"),
    (dict(world_size=8, ep=8, etp=1), None),
    (dict(world_size=16, ep=16), "num_experts = 8 is not divisible by ep = 16"),
    (dict(world_size=8, tp=2, etp=4, ep=2), None),
])
def test_check_fold_names_the_size_that_does_not_divide(fold, message):
    from meshfold.models.configs import get_config
    from meshfold.parallel.transformer_plan import check_fold

    spec = FoldSpec(**fold)
    if message is None:
        check_fold(get_config("tiny-deepseek-v3"), spec)
    else:
        with pytest.raises(ValueError, match=message):
            check_fold(get_config("tiny-deepseek-v3"), spec)


# ----------------------------------------------------------------------------- training, export, plan


@pytest.mark.slow
def test_train_tiny_deepseek_v3_then_export_for_transformers(tmp_path):
    """``meshfold train --set model.name=tiny-deepseek-v3`` learns and moves the correction bias
    (aux-loss-free balancing); ``meshfold export`` writes what transformers runs identically."""
    from safetensors import safe_open

    from tests.run_here import meshfold_here as meshfold
    from tests.train.test_train import losses
    from meshfold.train.trained import load_trained

    run = tmp_path / "run"
    proc = meshfold("train", "--set", 'model.name="tiny-deepseek-v3"', "--steps", "10", "--out-dir", str(run),
                    "--set", "train.batch=4", "--set", "train.seq=32", "--set", "train.eval_every=1000",
                    "--set", "train.warmup=2", "--set", "fold.world_size=2", "--set", "fold.ep=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = losses(run)
    assert rows[10]["loss"] < rows[1]["loss"] - 1.0, (rows[1]["loss"], rows[10]["loss"])
    assert meshfold("export", str(run), str(tmp_path / "hf")).returncode == 0
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.abs().max() > 0
    model, _ = load_trained(str(run))
    theirs = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                   experts_implementation="eager").eval()
    t = tokens(256, S=16)
    with torch.no_grad():
        torch.testing.assert_close(theirs(t).logits, model(t), **TOL32)


def test_plan_counts_mla_parameters_flops_and_kv_size():
    """The plan's MLA shape: attention parameters as the module has them, attention FLOPs as
    torch's FLOP counter counts one MLA forward (x3 for fwd + bwd), the latent as the KV size."""
    from torch.utils.flop_counter import FlopCounterMode

    from meshfold.models.configs import get_config
    from meshfold.models.mla import MLA
    from meshfold.plan.models import MODELS

    for name in ("tiny-deepseek-v3", "deepseek-v2-lite"):  # with and without the q latent
        cfg, shape = get_config(name), MODELS[name]
        with torch.device("meta"):
            attn = MLA(cfg.hidden, cfg.heads, cfg.mla, cfg.rope_theta)
        assert shape.attn_params == sum(p.numel() for n, p in attn.named_parameters() if "norm" not in n)
    cfg, shape = get_config("tiny-deepseek-v3"), MODELS["tiny-deepseek-v3"]
    B, S = 2, 32
    with FlopCounterMode(display=False) as counter:
        MLA(cfg.hidden, cfg.heads, cfg.mla, cfg.rope_theta)(torch.randn(B, S, cfg.hidden))
    h, L = shape.hidden, shape.layers
    moe_mlp = 3 * h * (shape.topk * shape.expert_ffn + shape.shared_ffn)
    dense_mlp = 3 * h * cfg.ffn  # its first layer is dense
    mlp_and_head = 6 * B * S * (shape.moe_layers * moe_mlp + shape.dense_layers * dense_mlp + h * shape.vocab)
    assert shape.dense_layers == cfg.first_k_dense == 1
    assert shape.step_flops(B, S) == pytest.approx(3 * L * counter.get_total_flops() + mlp_and_head, rel=1e-12)
    v3 = MODELS["deepseek-v3-671b"]
    assert v3.kv_per_token == 512 + 64  # against 2 * 128 * (128 + 64) expanded


@pytest.mark.multirank
def test_plain_q_projection_folds_over_tp_and_cp(worlds):
    """DeepSeek-V2-Lite's q (no latent): wq column-parallel by head, as GQA's."""
    spec = FoldSpec(4, cp=2, tp=2, ep=4)
    assert all(worlds(4).run(_run_folded, (spec, 2, 8, 4, "allreduce", 0.0, False)))


def test_multi_token_prediction_layers_not_built_are_skipped_but_unknown_tensors_are_not(tmp_path):
    import dataclasses

    from safetensors.torch import load_file, save_file

    from meshfold.interop.hf import config_from_hf

    hf_checkpoint(tmp_path)
    cfg = dataclasses.replace(config_from_hf(json.loads((tmp_path / "config.json").read_text())), mtp_depth=0)
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = {f"model.layers.{cfg.layers}.eh_proj.weight": torch.zeros(cfg.hidden, 2 * cfg.hidden)}
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors")
    load_state(tmp_path, cfg)  # an MTP layer (num_hidden_layers) the config does not build: skipped
    save_file({**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"not used by the config .*self_attn\.extra\.weight"):
        load_state(tmp_path, cfg)


def test_mla_config_saved_as_another_architecture_is_refused():
    from meshfold.models.configs import get_config
    from meshfold.interop.hf import config_to_hf

    with pytest.raises(ValueError, match="MixtralForCausalLM cannot express this config: mla"):
        config_to_hf(get_config("tiny-deepseek-v3"), "MixtralForCausalLM")
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM cannot express this config: mla=None"):
        config_to_hf(get_config("tiny-qwen3-moe"), "DeepseekV3ForCausalLM")


def test_deepseek_v3_hub_config_maps_to_the_named_config():
    """deepseek-ai/DeepSeek-V3's config.json (its legacy ``rope_scaling`` spelling, the fields
    meshfold reads) gives exactly ``deepseek-v3-671b`` with its one multi-token-prediction depth."""
    import dataclasses

    from meshfold.models.configs import get_config
    from meshfold.interop.hf import config_from_hf

    hub = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
           "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
           "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
           "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
           "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
           "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "tie_word_embeddings": False, "attention_bias": False}
    assert config_from_hf(hub) == dataclasses.replace(get_config("deepseek-v3-671b"), mtp_depth=1)
