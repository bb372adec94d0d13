"""DeepSeek-V3 checkpoints with multi-token-prediction layers, against transformers' own reader.

transformers' ``DeepseekV3ForCausalLM`` builds no MTP layer; its ``MtpModel`` (modeling_layers.py)
reads one from the checkpoint's layer ``num_hidden_layers`` (``enorm``, ``hnorm``, ``eh_proj``, the
decoder layer, ``shared_head.norm``) for speculative decoding, and raises if a weight is missing.
A meshfold model with MTP is exported, read back by meshfold and by transformers, and the main
head's and depth 1's logits are compared with transformers'.
"""

import dataclasses

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel

from meshfold.interop.hf import from_pretrained, save_pretrained
from meshfold.models.transformer import MoETransformer
from tests.models.test_deepseek_v3 import TOL32, hf_checkpoint, tokens


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(meshfold model with mtp_depth = 1, its export folder), from a random transformers model."""
    plain = tmp_path_factory.mktemp("plain")
    hf_checkpoint(plain, seed=3)  # transformers writes num_nextn_predict_layers = 1 and no MTP weights
    main = from_pretrained(plain, dtype=torch.float32)
    assert main.cfg.mtp_depth == 0
    model = MoETransformer(dataclasses.replace(main.cfg, mtp_depth=1), dtype=torch.float32, seed=0)
    missing, unexpected = model.load_state_dict(main.state_dict(), strict=False)
    assert not unexpected and all(n.startswith("mtp.") for n in missing)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # unit-scale MTP weights, norms away from 1, a non-zero correction bias
        for name, t in list(model.mtp.named_parameters()) + list(model.mtp.named_buffers()):
            r = torch.randn(t.shape, generator=g)
            t.copy_(1 + 0.2 * r if "norm" in name else 0.3 * r if "bias" in name else r * t.shape[-1] ** -0.5)
    out = tmp_path_factory.mktemp("mtp")
    save_pretrained(model, out)
    return model, out


def test_export_writes_deepseek_v3_mtp_keys(exported):
    model, out = exported
    L = model.cfg.layers
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = {k for k in f.keys() if k.startswith(f"model.layers.{L}.")}
        same = [torch.equal(f.get_tensor(f"model.layers.{L}.embed_tokens.weight"), model.embed.weight),
                torch.equal(f.get_tensor(f"model.layers.{L}.shared_head.head.weight"), model.head.weight)]
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "input_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight",
                 "mlp.shared_experts.down_proj.weight"):
        assert f"model.layers.{L}.{name}" in keys, name
    assert all(same)  # the copies DeepSeek-V3 stores are the shared embedding and head


def test_meshfold_reads_its_export_back_exactly(exported):
    model, out = exported
    back = from_pretrained(out, dtype=torch.float32)
    assert back.cfg.mtp_depth == 1
    want = model.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, want[name]), name


def test_transformers_reads_the_export_main_and_depth_1_logits_equal(exported):
    model, out = exported
    L = model.cfg.layers
    hf = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager").eval()
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]  # its pattern names layer 61
    mtp = MtpModel.from_pretrained(hf).eval()  # raises on any MTP weight missing
    t = tokens(model.cfg.vocab)
    S = t.shape[1]
    with torch.no_grad():
        h0 = hf.model(t).last_hidden_state  # [B, S, H] after the final norm: what depth 1 reads
        torch.testing.assert_close(model(t), hf.lm_head(h0), **TOL32)
        pos = torch.arange(S - 1)[None]
        theirs = mtp._project_to_logits(mtp.forward_layer(0, h0[:, :-1], pos, None, input_ids=t[:, 1:]))
        h = model.norm(model._hidden(t, None))[:, :-1]
        ours = model._head(model.mtp[0](h, model.embed(t[:, 1:]), torch.arange(S - 1)))
    assert theirs.abs().max() > 1  # not near-uniform: the comparison has teeth
    torch.testing.assert_close(ours, theirs, **TOL32)
