"""The Hugging Face export of a model of one's own: its tensors written under the names a mapping
(recipes) gives them, with nothing dropped or invented silently."""

import pytest
import torch
from safetensors.torch import load_file

from meshfold.interop.hf import save_mapped
from meshfold.interop.recipes import Leaf, Stack, leaves, linear
from tests.parallel.test_layout_plan import E, TinyLM


def _recipes(model):
    """A target architecture's names for TinyLM: per-expert [out, in] matrices, as transformers
    writes experts, and nn.Linear-style transposes of the attention projections."""
    r = {"tok.weight": Leaf("model.embed_tokens.weight"), "unembed.weight": Leaf("lm_head.weight"),
         "final.scale": Leaf("model.norm.weight")}
    for i, _ in enumerate(model.blocks):
        hf, mine = f"model.layers.{i}", f"blocks.{i}"
        r[f"{mine}.ln.scale"] = Leaf(f"{hf}.input_layernorm.weight")
        for w in ("to_q", "to_k", "to_v", "proj"):
            r[f"{mine}.mixer.{w}"] = linear(f"{hf}.self_attn.{w}.weight")
        r[f"{mine}.ffn.router.weight"] = Leaf(f"{hf}.mlp.gate.weight")
        for w in ("w_in", "w_out"):
            r[f"{mine}.ffn.experts.{w}"] = Stack(tuple(linear(f"{hf}.mlp.experts.{e}.{w}.weight") for e in range(E)), 0)
    return r


def _rebuild(recipe, tensors):
    """The parameter a recipe describes, put back together from the written tensors."""
    if isinstance(recipe, Leaf):
        t = tensors[recipe.key]
        return t.T if recipe.transpose else t
    return torch.stack([_rebuild(p, tensors) for p in recipe.parts], recipe.dim)


def test_a_custom_model_exports_under_its_mapping_and_reads_back_bitwise(tmp_path):
    model = TinyLM()
    state, recipes = model.state_dict(), _recipes(model)
    assert state.keys() == recipes.keys()  # the mapping covers the whole model
    save_mapped(state, recipes, tmp_path / "hf", {"architectures": ["TinyLMForCausalLM"]}, dtype=torch.float32,
                keep_dtype=lambda name: name.endswith("router.weight"))
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(written) == sorted(leaf.key for r in recipes.values() for leaf in leaves(r))
    assert written["model.layers.0.mlp.experts.3.w_in.weight"].shape == model.blocks[0].ffn.experts.w_in[3].T.shape
    for name, recipe in recipes.items():
        back = _rebuild(recipe, written)
        want = state[name] if name.endswith("router.weight") else state[name].float()
        assert back.dtype == want.dtype and torch.equal(back, want), name
    assert '"TinyLMForCausalLM"' in (tmp_path / "hf" / "config.json").read_text()


def test_a_tensor_without_a_recipe_or_a_recipe_without_a_tensor_is_named(tmp_path):
    model = TinyLM()
    state, recipes = model.state_dict(), _recipes(model)
    partial = {n: r for n, r in recipes.items() if n != "final.scale"}
    with pytest.raises(ValueError, match=r"no recipe for \['final.scale'\]"):
        save_mapped(state, partial, tmp_path / "a", {})
    save_mapped(state, partial, tmp_path / "b", {}, skip=("final.scale",))  # said, not silent
    with pytest.raises(ValueError, match=r"recipes name \['blocks.9.ln.scale'\]"):
        save_mapped(state, {**recipes, "blocks.9.ln.scale": Leaf("x")}, tmp_path / "c", {})
