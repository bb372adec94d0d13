"""MoETransformer on one device: Hugging Face checkpoints in and out, and attention from positions.

Tiny random Mixtral, Qwen2-MoE (qkv bias, gated shared expert, dense layers between MoE layers)
and Qwen3-MoE (q/k norm, head_dim != hidden / heads, a dense first layer) models are built with
transformers (test-only dependency, nothing downloaded), written with its ``save_pretrained``
and read with ``meshfold.interop.hf.from_pretrained``. Weights are drawn at unit scale (not HF's
std 0.02 init), so attention is far from uniform and a wrong RoPE shows in the logits.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from meshfold.models import CONFIGS, MoETransformer, TransformerConfig, get_config
from meshfold.interop.hf import from_pretrained, save_pretrained
from meshfold.models.config import MoEConfig
from meshfold.interop.hf import config_to_hf, load_state

TIGHT = dict(rtol=1e-5, atol=1e-5)  # fp32; a wrong rope_theta moves logits by > 1e-2
V, S = 256, 16
COMMON = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, tie_word_embeddings=False)
HF_MODELS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_hidden_layers=2, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_hidden_layers=4, decoder_sparse_step=2, intermediate_size=80, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=4,
                       norm_topk_prob=False, qkv_bias=True)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=3, mlp_only_layers=[0], head_dim=32, intermediate_size=80,
                       moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale weights: N(0, 1/fan_in) for matrices, 1 + N(0, 0.1) for norms, N(0, 0.1) biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            else:
                p.copy_(r * p.shape[-1] ** -0.5)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """``hf(kind) -> (HF model, checkpoint dir)``, built and saved once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cfg_cls, model_cls, kw = HF_MODELS[kind]
            torch.manual_seed(0)
            model = model_cls(cfg_cls(**COMMON, **kw, attn_implementation="eager")).eval()
            randomize(model, seed=len(cache) + 1)
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            cache[kind] = model, path
        return cache[kind]

    return get


def tokens(B=2, seed=0):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(model, tok):
    return model(tok).logits


def safetensors_keys(path):
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            keys |= set(h.keys())
    return keys


# ----------------------------------------------------------------------------- HF equivalence


@pytest.mark.parametrize("kind", list(HF_MODELS))
def test_logits_match_transformers_after_loading_its_checkpoint(hf, kind):
    model, path = hf(kind)
    ours = from_pretrained(path)
    tok = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(tok), hf_logits(model, tok), **TIGHT)


def test_checkpoint_config_maps_to_the_layer_pattern_and_attention_options(hf):
    assert from_pretrained(hf("mixtral")[1]).cfg.moe_layer_ids == [0, 1]
    q2 = from_pretrained(hf("qwen2_moe")[1]).cfg
    assert (q2.moe_layer_ids, q2.qkv_bias, q2.moe.shared_ffn, q2.moe.renormalize) == ([1, 3], True, 48, False)
    q3 = from_pretrained(hf("qwen3_moe")[1]).cfg
    assert (q3.moe_layer_ids, q3.qk_norm, q3.head_dim, q3.moe.renormalize) == ([1, 2], True, 32, True)


def test_wrong_rope_theta_breaks_the_match(hf, tmp_path):
    model, path = hf("qwen3_moe")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tok = tokens()
    with torch.no_grad():
        diff = (from_pretrained(tmp_path)(tok) - hf_logits(model, tok)).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("kind", list(HF_MODELS))
def test_meshfold_save_round_trips_through_transformers_and_meshfold(hf, kind, tmp_path):
    model, path = hf(kind)
    ours = from_pretrained(path)
    save_pretrained(ours, tmp_path)
    assert safetensors_keys(tmp_path) == safetensors_keys(path)
    tok = tokens(seed=1)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf_logits(model, tok)
        torch.testing.assert_close(hf_logits(reloaded, tok), expected, rtol=0, atol=0)
        torch.testing.assert_close(from_pretrained(tmp_path)(tok), ours(tok), rtol=0, atol=0)


def test_sharded_checkpoint_loads_like_a_single_file(hf, tmp_path):
    model, _ = hf("mixtral")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    tok = tokens()
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path)(tok), hf_logits(model, tok), **TIGHT)


def test_transformers_4x_config_spelling_loads_the_same(hf, tmp_path):
    """4.x configs: top-level rope_theta with rope_scaling null, Qwen3-MoE's num_experts."""
    model, path = hf("qwen3_moe")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tok = tokens()
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path)(tok), hf_logits(model, tok), **TIGHT)


def test_tied_embeddings_load_and_save_without_lm_head(tmp_path):
    cfg_cls, model_cls, kw = HF_MODELS["qwen3_moe"]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, "tie_word_embeddings": True}, **kw, attn_implementation="eager")).eval()
    randomize(model, seed=7)
    model.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    assert ours.cfg.tie_embeddings and ours.head is None
    save_pretrained(ours, tmp_path / "ours")
    assert "lm_head.weight" not in safetensors_keys(tmp_path / "ours")
    tok = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(tok), hf_logits(model, tok), **TIGHT)


def test_select_reads_the_requested_slices_of_each_parameter(hf):
    path = hf("qwen2_moe")[1]
    cfg = from_pretrained(path).cfg
    full = load_state(path, cfg)
    picks = {"layers.1.mlp.experts.w_gate_up": (slice(2, 5), slice(None), slice(None), slice(8, 24)),
             "layers.1.mlp.experts.w_down": (slice(6, 8), slice(8, 24)),
             "layers.0.attn.wq": (slice(None), slice(32, 64)),
             "layers.0.mlp.w_gate_up": (slice(None), slice(1, 2))}
    part = load_state(path, cfg, select=picks.get)
    for name, t in full.items():
        assert torch.equal(part[name], t[picks.get(name, ())]), name


# ----------------------------------------------------------------------------- named configs


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("tiny-")])
def test_tiny_named_configs_are_valid_transformers_models(name, tmp_path):
    """config_to_hf gives transformers a model with the same parameter count and logits."""
    torch.manual_seed(0)
    ours = MoETransformer(get_config(name))
    save_pretrained(ours, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())
    tok = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(tok), hf_logits(theirs, tok), **TIGHT)


def test_paper_configs_have_the_paper_shapes():
    g8t8, q2 = get_config("mixtral-8x22b-g8t8"), get_config("qwen2-57b-a14b")
    assert (g8t8.hidden, g8t8.layers, g8t8.moe.num_experts, g8t8.moe.ffn, g8t8.moe.topk) == (6144, 56, 64, 2048, 8)
    assert (q2.moe.num_experts, q2.moe.topk, q2.moe.shared_ffn, q2.moe.renormalize) == (64, 8, 20480, False)
    assert get_config("qwen3-30b-a3b").head_dim == 128


# ----------------------------------------------------------------------------- bad input


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture_is_named_with_the_supported_ones(hf, tmp_path):
    edit_config(hf("mixtral")[1], tmp_path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        from_pretrained(tmp_path)


def test_shape_mismatch_names_the_tensor_and_both_shapes(hf, tmp_path):
    edit_config(hf("mixtral")[1], tmp_path, intermediate_size=64)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight' "
                                         r"has shape \[96, 64\] but the config expects \[64, 64\]"):
        from_pretrained(tmp_path)


def test_missing_tensor_is_named(hf, tmp_path):
    src = hf("qwen3_moe")[1]
    edit_config(src, tmp_path)
    state = load_file(src / "model.safetensors")
    del state["model.layers.2.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.2\.self_attn\.k_norm\.weight'"):
        from_pretrained(tmp_path)


def test_checkpoint_with_more_experts_than_the_config_is_rejected(hf, tmp_path):
    edit_config(hf("qwen3_moe")[1], tmp_path, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"shape \[8, 64\] but the config expects \[4, 64\]"):
        from_pretrained(tmp_path)


def test_saving_a_config_the_architecture_cannot_express_names_the_features():
    cfg = get_config("tiny-mixtral")
    cfg.moe.score_function = "sigmoid"
    with pytest.raises(ValueError, match=r"MixtralForCausalLM cannot express.*'sigmoid'"):
        config_to_hf(cfg)
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM cannot express.*qk_norm=False \(needs True\)"):
        config_to_hf(get_config("tiny-mixtral"), "Qwen3MoeForCausalLM")


def test_bad_transformer_configs_name_the_value():
    with pytest.raises(ValueError, match=r"heads = 4 must be a multiple of kv_heads = 3"):
        TransformerConfig(vocab=8, hidden=16, layers=1, heads=4, kv_heads=3, ffn=8)
    with pytest.raises(ValueError, match=r"ffn = 0 but layers \[0\] are dense"):
        TransformerConfig(vocab=8, hidden=16, layers=2, heads=4, first_k_dense=1,
                          moe=MoEConfig(hidden=16, ffn=8, num_experts=2, topk=1))
    with pytest.raises(ValueError, match=r"unknown model config 'gpt5'.*tiny-mixtral"):
        get_config("gpt5")


# ----------------------------------------------------------------------------- positions


def test_loss_is_mean_cross_entropy_ignoring_minus_100():
    torch.manual_seed(0)
    model = MoETransformer(get_config("tiny-mixtral"))
    tok = tokens()
    targets = tok.roll(-1, 1)
    targets[:, -3:] = -100
    with torch.no_grad():
        logits = model(tok)
        expected = F.cross_entropy(logits[:, :-3].reshape(-1, V), targets[:, :-3].reshape(-1))
        torch.testing.assert_close(model.loss(tok, targets), expected)


def test_explicit_positions_equal_the_default_causal_path():
    torch.manual_seed(0)
    model = MoETransformer(get_config("tiny-qwen3-moe"), dtype=torch.float64)
    tok = tokens()
    with torch.no_grad():
        ref = model(tok)
        torch.testing.assert_close(model(tok, torch.arange(S)), ref)
        torch.testing.assert_close(model(tok, torch.arange(S).expand(2, S)), ref)


def test_causal_by_index_equals_the_mask_from_increasing_positions():
    """Without context parallelism Attention masks by index (SDPA's is_causal); for tokens in
    sequence order that is the mask from positions, whatever the gaps between them."""
    from meshfold.models.attention import attend

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.sort(torch.randperm(100, generator=g)[:24]).values + 7
    torch.testing.assert_close(attend(q, k, v), attend(q, k, v, pos, pos), rtol=1e-12, atol=1e-12)


def test_gqa_reaches_a_fused_kernel_in_every_dtype_off_the_cpu(monkeypatch):
    """Off the CPU only the flash kernel takes GQA (``enable_gqa``), in fp16 / bf16 without a
    mask; SDPA asked for GQA otherwise runs the math kernel (fp32 [Sq, Sk] scores), so there K/V
    arrive repeated to the query heads. On the CPU every kernel takes GQA itself. The repeated
    call gives the grouped call's values."""
    import contextlib

    import torch.nn.functional as F

    from meshfold.models.attention import attend
    from meshfold.testing.references import OffCPU

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(6)
    sdpa, calls = F.scaled_dot_product_attention, []

    def recording(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        calls.append((k.shape[1], enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    want = {True: attend(q, k, v), False: attend(q, k, v, pos, pos)}
    for dtype, off_cpu, masked, grouped in [(torch.float32, True, False, False), (torch.float32, True, True, False),
                                            (torch.bfloat16, True, False, True), (torch.bfloat16, True, True, False),
                                            (torch.float32, False, False, True), (torch.float32, False, True, True)]:
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        if off_cpu:
            qd, kd, vd = OffCPU(qd), OffCPU(kd), OffCPU(vd)
        calls.clear()
        with OffCPU.everywhere() if off_cpu else contextlib.nullcontext():
            out = attend(qd, kd, vd, pos, pos) if masked else attend(qd, kd, vd)
        assert calls == [(2, True) if grouped else (4, False)], (dtype, off_cpu, masked, calls)
        out = out.inner if off_cpu else out
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), want[not masked], rtol=tol, atol=tol)


def test_attention_saves_no_sequence_squared_tensor_without_context_parallelism():
    """Masking by positions made SDPA save an [S, S] fp32 mask per layer for backward (16 MiB
    a layer at S = 2048); in sequence order nothing quadratic in S is kept."""
    torch.manual_seed(0)
    model = MoETransformer(get_config("tiny-qwen3-moe"), dtype=torch.float64)
    tok = tokens()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tok, torch.arange(S))
    assert saved and not [shape for shape in saved if shape[-2:] == (S, S)]


def test_causal_mask_cache_shares_one_mask_while_positions_stay_the_same():
    from meshfold.models.attention import CausalMaskCache, attend, causal_mask

    masks = CausalMaskCache()
    q_pos, k_pos = torch.tensor([0, 1, 6, 7]), torch.tensor([4, 0, 6, 2, 1, 7, 3, 5])
    first = masks(q_pos, k_pos, torch.float32)
    assert torch.equal(first, causal_mask(q_pos, k_pos, torch.float32))
    assert masks(q_pos, k_pos, torch.float32) is first
    assert masks(q_pos.clone(), k_pos.clone(), torch.float32) is first  # equal values, on the CPU
    assert masks(q_pos, k_pos, torch.float64) is not first
    shifted = q_pos + 1
    other = masks(shifted, k_pos, torch.float64)
    assert torch.equal(other, causal_mask(shifted, k_pos, torch.float64))
    shifted += 0  # changed in place (same values here): compared again, still shared
    assert masks(shifted, k_pos, torch.float64) is other
    shifted[0] = 0  # changed in place: a new mask, not the stale one
    assert torch.equal(masks(shifted, k_pos, torch.float64), causal_mask(shifted, k_pos, torch.float64))
    del first, other  # held weakly: once nothing needs the mask it is gone, and built again
    assert masks._mask() is None
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    assert torch.equal(attend(q, k, v, q_pos, k_pos, masks), attend(q, k, v, q_pos, k_pos))


def test_positions_out_of_sequence_order_raise_naming_them():
    model = MoETransformer(get_config("tiny-qwen3-moe"), dtype=torch.float64)
    bad = torch.arange(S).flip(0)
    with pytest.raises(ValueError, match=r"positions \[%d, %d, .* do not increase" % (S - 1, S - 2)):
        model(tokens(), bad)


@pytest.mark.parametrize("local", [list(range(S // 2, S)),  # second half, keys from the whole
                                   list(range(S // 4)) + list(range(3 * S // 4, S))])  # CP chunks 0 and 3
def test_queries_on_part_of_the_sequence_with_all_keys_equal_the_full_forward(local):
    """The property context parallelism relies on: a rank holding tokens at ``local`` positions,
    given the K/V of every token (its own computed locally, the rest in shuffled order), gets the
    full forward's logits at those positions."""
    torch.manual_seed(0)
    model = MoETransformer(get_config("tiny-qwen3-moe"), dtype=torch.float64)
    tok = tokens()
    recorded = []

    def record(k, v, pos):
        recorded.append((k, v))
        return k, v, pos

    for b in model.layers:
        b.attn.kv_gather = record
    with torch.no_grad():
        full = model(tok)
    P = torch.tensor(local)
    others = torch.tensor([i for i in reversed(range(S)) if i not in local])  # shuffled order
    for layer, b in enumerate(model.layers):
        def gather(k, v, pos, layer=layer):
            k_full, v_full = recorded[layer]
            return (torch.cat([k, k_full[:, :, others]], 2), torch.cat([v, v_full[:, :, others]], 2),
                    torch.cat([pos, others]))
        b.attn.kv_gather = gather
    with torch.no_grad():
        part = model(tok[:, P], positions=P)
    torch.testing.assert_close(part, full[:, P], rtol=1e-10, atol=1e-10)
