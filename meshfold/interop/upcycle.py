"""Upcycling: a dense Hugging Face checkpoint (Llama, Mistral, Qwen2) -> an MoE checkpoint
(Mixtral, Qwen2-MoE), and a dense DeepSeek-V3 -> a DeepSeek-V3 MoE, whose every MoE layer starts
as the dense MLP.

Legend: H = hidden, F = dense ffn, E = copies of the MLP (``--experts``), G = granularity, k =
top-k per copy; the MoE has N = E*G experts of ffn F/G and routes each token to k*G of them.

Method (Megatron-Core's, He et al., "Upcycling Large Language Models into Mixture of Experts",
arXiv 2410.07524), restated for these targets:

* **Coarse** (G = 1): every expert is a copy of the dense MLP (gate, up, down); the router is
  random, N(0, 1/H). Both targets route softmax-over-all-experts -> top-k -> renormalise (Mixtral
  always; Qwen2-MoE with ``norm_topk_prob = true``, which is written), so the k weights of a token
  sum to 1 and the layer's output is ``sum_j w_j MLP(x) = MLP(x)``: **equal to the dense model for
  any router weights and any token**.
* **Granular** (G > 1, the paper's "virtual groups"): expert ``j = e*G + g`` (copy e, slice g)
  holds rows ``g*F/G .. (g+1)*F/G`` of gate and up and the same columns of down. The router has E
  random rows, each repeated G times (row j = row e), so the G slices of a copy get bitwise-equal
  logits. When the top-k*G selection consists of k whole groups (it does whenever the k-th and
  (k+1)-th best copy logits differ, i.e. for all tokens but ties), each selected slice gets weight
  ``q_e / G`` with ``sum_e q_e = 1`` (renormalised), so the layer outputs ``MLP(x) / G``. Down is
  therefore scaled by G, making the output **exactly the dense MLP under that routing condition**.

  Megatron-Core spreads its scale over all three matrices (``scale ** (1/3)`` each, the paper's
  weight scaling), which is exact only for a positively homogeneous activation: SiLU is not, so
  ``silu(c z) != c silu(z)``. Gate and up are kept unscaled here (the SiLU sees the dense
  pre-activations) and the whole factor G goes on down, the one matrix the output is linear in: one
  rounding, none when G is a power of two. Megatron's other case, softmax-then-top-k *without*
  renormalisation, equals the dense model only in expectation over the router (scale E*G/k), so
  it is not offered.

**DeepSeek-V3** (``--arch deepseek_v3``, :mod:`.upcycle_deepseek` has the details): the source
is a ``DeepseekV3ForCausalLM`` whose layers are all dense, never a Llama / Mistral / Qwen2, whose
GQA attention has no exact MLA form (a one-line error says so). MLA is copied; layers
``--first-dense K`` (default 0) .. L-1 get experts under DeepSeek-V3's sigmoid router with a zero
correction bias, ``norm_topk_prob``, ``routed_scaling_factor = 1`` and no shared expert, so the
weights again sum to 1 (k*G >= 2) and both statements above hold, coarse for any router and bias.
``--shared-slices S`` makes the first S of the G slices one shared expert (unscaled), leaving
R = G - S routed slices per copy: the same statement with R for G.
With ``--n-group n --topk-group t`` (groups of whole copies) the granular condition reads "the
k-th and (k+1)-th best copy scores among the t kept groups' copies differ"; ``--n-group E
--topk-group k`` routes whole virtual groups for every token, ties included.

Nothing else changes: attention, norms, embeddings and the head are copied as they are, so the
upcycled model's logits equal the dense model's (fp32: rounding of the sum over experts only).
A Qwen2-MoE target has no shared expert (``shared_expert_intermediate_size = 0``); transformers
lists its zero-element tensors and their gate as missing when it loads the checkpoint, which is
harmless (the shared branch adds ``sigmoid(gate x) * 0``), and meshfold reads no such tensors.
Input jitter or capacity dropping in training breaks whole-group routing, as it should: the
equality is a statement about the initial model, not about every routing configuration.
Training breaks the symmetry: tokens reach different copies, and each slice's router row gets its
own gradient.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshfold.interop import upcycle_deepseek

__all__ = ["DENSE", "TARGETS", "dense_config", "moe_config", "router_weight", "expert_slices", "upcycle"]

# transformers 5.24 class defaults for the fields read here (a config.json may omit defaults)
DENSE = {
    "LlamaForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                             rope_theta=10000.0),
    "MistralForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                               rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096),
    "Qwen2ForCausalLM": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                             rms_norm_eps=1e-6, rope_theta=10000.0),
}
TARGETS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v3": upcycle_deepseek.ARCH}
SHARD_BYTES = 4 << 30  # an output shard closes once it holds this much
_COPIED = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept from the dense config.json


def dense_config(src: Path) -> tuple[str, dict]:
    """(architecture, config with class defaults filled in) of a dense checkpoint folder; a
    ValueError naming what makes it not a dense Llama / Mistral / Qwen2 checkpoint meshfold can
    upcycle."""
    path = Path(src) / "config.json"
    if not path.is_file():
        raise ValueError(f"SRC {src} is not a Hugging Face checkpoint folder (no config.json)")
    hf = json.loads(path.read_text())
    arch = (hf.get("architectures") or [None])[0]
    if arch == upcycle_deepseek.ARCH:
        return arch, upcycle_deepseek.dense_config(src, hf)
    if arch not in DENSE:
        raise ValueError(f"SRC {src} is {arch!r}, not a dense checkpoint meshfold can upcycle "
                         f"(valid: {', '.join(DENSE)}, or a {upcycle_deepseek.ARCH} whose layers are all dense)")
    c = {**DENSE[arch], **{k: v for k, v in hf.items() if v is not None}}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    c["rope_theta"] = float(rope.get("rope_theta", c["rope_theta"]))
    bad = []
    if c.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act = {c['hidden_act']!r} (valid: 'silu')")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        bad.append(f"rope_type = {rope.get('rope_type', rope.get('type'))!r} (valid: 'default')")
    if c.get("attention_bias") or c.get("mlp_bias"):
        bad.append("attention_bias / mlp_bias = true (valid: false)")
    if arch == "MistralForCausalLM" and hf.get("sliding_window", c["sliding_window"]) is not None:
        bad.append(f"sliding_window = {c['sliding_window']} (valid: null)")
    if arch == "Qwen2ForCausalLM" and c.get("use_sliding_window"):
        bad.append("use_sliding_window = true (valid: false)")
    if bad:
        raise ValueError(f"SRC {src} ({arch}) has what meshfold's MoE models cannot express: {'; '.join(bad)}")
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    return arch, c


def moe_config(dense_arch: str, c: dict, arch: str, experts: int, topk: int, granularity: int = 1,
               first_dense: int | None = None, n_group: int | None = None, topk_group: int | None = None,
               shared_slices: int | None = None):
    """(meshfold TransformerConfig, ``config.json`` dict) of the upcycled model; every bad
    argument is a one-line ValueError naming it and what is valid. ``first_dense``, ``n_group``,
    ``topk_group`` and ``shared_slices`` are DeepSeek-V3's (:func:`.upcycle_deepseek.moe_config`)."""
    from meshfold.models.config import MoEConfig
    from meshfold.interop.hf import config_to_hf
    from meshfold.models.transformer import TransformerConfig

    E, k, G, F = experts, topk, granularity, c["intermediate_size"]
    for name, v in (("--experts", E), ("--topk", k), ("--granularity", G)):
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if k > E:
        raise ValueError(f"--topk {k} exceeds --experts {E} (valid: 1..{E}): each token picks k of the "
                         f"E copies of the MLP")
    if F % G:
        raise ValueError(f"--granularity {G} does not divide the dense ffn (intermediate_size) {F} "
                         f"(valid: {[g for g in range(1, F + 1) if F % g == 0 and g <= 64]})")
    if (arch == upcycle_deepseek.ARCH) != (dense_arch == upcycle_deepseek.ARCH):
        if dense_arch == upcycle_deepseek.ARCH:
            raise ValueError(f"--arch {_name(arch)}: SRC is a {dense_arch}, whose MLA attention that target "
                             f"cannot hold; use --arch deepseek_v3")
        raise ValueError(f"--arch deepseek_v3 needs a dense {upcycle_deepseek.ARCH} SRC: {dense_arch}'s GQA "
                         f"attention has no exact MLA form (MLA normalises a per-token latent and shares one "
                         f"RoPE key across heads); use --arch "
                         f"{'qwen2_moe' if dense_arch == 'Qwen2ForCausalLM' else 'mixtral or qwen2_moe'}")
    if arch == upcycle_deepseek.ARCH:
        return upcycle_deepseek.moe_config(c, E, k, G, first_dense, n_group, topk_group, shared_slices)
    given = [f for f, v in (("--first-dense", first_dense), ("--n-group", n_group), ("--topk-group", topk_group),
                            ("--shared-slices", shared_slices)) if v is not None]
    if given:
        raise ValueError(f"{given[0]} is DeepSeek-V3's; --arch {_name(arch)} has no such setting")
    qkv_bias = dense_arch == "Qwen2ForCausalLM"  # Qwen2's q/k/v projections always carry a bias
    if qkv_bias and arch == "MixtralForCausalLM":
        raise ValueError("--arch mixtral: a Qwen2 checkpoint has q/k/v biases and Mixtral has none; "
                         "use --arch qwen2_moe")
    H, heads = c["hidden_size"], c["num_attention_heads"]
    moe = MoEConfig(hidden=H, ffn=F // G, num_experts=E * G, topk=k * G, renormalize=True)
    cfg = TransformerConfig(vocab=c["vocab_size"], hidden=H, layers=c["num_hidden_layers"], heads=heads,
                            kv_heads=c["num_key_value_heads"], head_dim=c.get("head_dim") or H // heads, ffn=F,
                            moe=moe, qkv_bias=qkv_bias, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                            rope_theta=c["rope_theta"], norm_eps=float(c["rms_norm_eps"]),
                            max_seq=c["max_position_embeddings"])
    dtype = c.get("dtype") or c.get("torch_dtype")
    hf = config_to_hf(cfg, arch)
    if dtype:
        hf["dtype"] = dtype
    hf.update({key: c[key] for key in _COPIED if key in c})
    return cfg, hf


def _name(arch: str) -> str:
    """The ``--arch`` value of a target architecture."""
    return next(name for name, a in TARGETS.items() if a == arch)


def router_weight(experts: int, granularity: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """[E*G, H] fp32: E rows drawn N(0, 1/H), row e repeated for experts e*G .. e*G+G-1 (a
    virtual group: one copy's G slices), so they get bitwise-equal logits."""
    rows_EH = torch.randn(experts, hidden, generator=generator, dtype=torch.float32) * hidden ** -0.5
    return rows_EH.repeat_interleave(granularity, dim=0)


def expert_slices(gate_FH, up_FH, down_HF, granularity: int):
    """The G experts one dense SwiGLU MLP splits into: ``(gate [F/G, H], up [F/G, H], down
    [H, F/G] * G)`` per slice of the ffn dim. Down carries the factor G that the renormalised
    routing divides a virtual group's output by (module docstring)."""
    G = granularity
    f = gate_FH.shape[0] // G
    for g in range(G):
        rows = slice(g * f, (g + 1) * f)
        down = down_HF[:, rows]
        yield gate_FH[rows], up_FH[rows], (down * G if G > 1 else down)


class _ShardWriter:
    """safetensors shards of at most ``limit`` bytes (one tensor may exceed it), then the index."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        self.pending[key] = t.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.folder / self.files[0][0], self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (name, keys) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / name, self.folder / final)
            weight_map.update({key: final for key in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _moe_keys(arch: str, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) checkpoint keys of one expert in ``arch`` (the names :mod:`.hf` reads)."""
    if arch == upcycle_deepseek.ARCH:
        return upcycle_deepseek.expert_keys(layer, expert)
    if arch == "MixtralForCausalLM":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def _in_layers(key: str, layers) -> bool:
    """Whether checkpoint ``key`` (``model.layers.N. ...``) belongs to one of ``layers``."""
    return int(key.split(".")[2]) in layers


def _router_key(arch: str, layer: int) -> str:
    if arch == upcycle_deepseek.ARCH:
        return upcycle_deepseek.router_keys(layer)[0]
    block = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def upcycle(src, out, experts: int, topk: int, granularity: int = 1, arch: str | None = None,
            ep: int | None = None, seed: int = 0, shard_bytes: int = SHARD_BYTES, stream=sys.stderr,
            first_dense: int | None = None, n_group: int | None = None, topk_group: int | None = None,
            shared_slices: int | None = None) -> dict:
    """Write the MoE checkpoint of ``src`` (a dense HF folder) to the new folder ``out``; returns
    its ``config.json`` dict.

    ``arch``: ``mixtral`` | ``qwen2_moe`` | ``deepseek_v3`` (default: deepseek_v3 for a dense
    DeepSeek-V3, the only target it fits; qwen2_moe for Qwen2, which has q/k/v biases; else
    mixtral). ``ep``: fail unless the E*G experts divide over it. DeepSeek-V3 only:
    ``first_dense`` (layers before it stay dense; default 0), ``n_group`` / ``topk_group``
    (group-limited routing over groups of whole copies; default 1 / n_group), ``shared_slices``
    (the first S of the G slices become one shared expert; default 0). The folder appears
    whole or not at all: everything is written into a hidden sibling folder, renamed to ``out``
    last. Tokenizer and other non-weight files of ``src`` are copied along.
    """
    from meshfold.interop.hf import _Checkpoint, checkpoint_map, config_from_hf
    from meshfold.interop.recipes import leaves

    src, out = Path(src), Path(out)
    if arch is not None and arch not in TARGETS:
        raise ValueError(f"--arch {arch!r}; valid: {', '.join(TARGETS)}")
    if out.exists():
        raise ValueError(f"OUT {out} exists; upcycle writes a new folder and never overwrites one")
    dense_arch, c = dense_config(src)
    default = {"Qwen2ForCausalLM": "qwen2_moe", upcycle_deepseek.ARCH: "deepseek_v3"}.get(dense_arch, "mixtral")
    target = TARGETS[arch or default]
    cfg, hf = moe_config(dense_arch, c, target, experts, topk, granularity, first_dense, n_group, topk_group,
                         shared_slices)
    n_experts = cfg.moe.num_experts
    if ep is not None and (ep < 1 or n_experts % ep):
        routed = f"E*G = {experts}*{granularity}" if n_experts == experts * granularity else "the routed"
        raise ValueError(f"{routed} = {n_experts} experts are not divisible by --ep {ep} "
                         f"(valid ep: {[d for d in range(1, n_experts + 1) if n_experts % d == 0]})")
    config_from_hf(hf)  # the written config.json must read back in meshfold (raises naming the field)
    expected = {leaf.key for r in checkpoint_map(cfg, target).values() for leaf in leaves(r)}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with ExitStack() as stack:
            ckpt = _Checkpoint(src, stack)
            _write_tensors(ckpt, cfg, target, experts, granularity, seed, _ShardWriter(tmp, shard_bytes),
                           expected, stream)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        for f in sorted(src.iterdir()):  # tokenizer, generation config, ...
            weights = f.suffix in (".safetensors", ".bin", ".pt", ".pth") or f.name.endswith(".index.json")
            if f.is_file() and not weights and f.name != "config.json" and not f.name.startswith("."):
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            raise ValueError(f"OUT {out} appeared while upcycling; left it alone")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return hf


def _write_tensors(ckpt, cfg, arch, E, G, seed, writer, expected, stream) -> None:
    """Every output tensor, in checkpoint order, with a progress line over them."""
    mlp = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(cfg.layers) for p in ("gate", "up", "down")}
    missing = sorted(mlp - set(ckpt.where))
    if missing:
        raise ValueError(f"SRC {ckpt.path} has no tensor {missing[0]!r}: not a dense checkpoint of its config")
    moe_ids = cfg.moe_layer_ids  # the others keep their dense MLP (DeepSeek-V3's first_k_dense_replace)
    others = [k for k in ckpt.where if (k not in mlp or not _in_layers(k, moe_ids))
              and not k.endswith("rotary_emb.inv_freq")]
    if cfg.tie_embeddings:
        others = [k for k in others if k != "lm_head.weight"]
    bias = arch == upcycle_deepseek.ARCH  # DeepSeek-V3's e_score_correction_bias, zero: selection unbiased
    f = cfg.moe.ffn
    S = cfg.moe.shared_ffn // f  # DeepSeek-V3's --shared-slices: the first S slices form the shared expert
    R = G - S  # routed slices per copy
    total = len(others) + len(moe_ids) * (1 + bias + 3 * E * R + 3 * bool(S))
    generator = torch.Generator().manual_seed(seed)
    done, written = 0, set()
    tty, every = stream.isatty(), -(-total // 20)  # in a log: at most 21 lines, not thousands

    def put(key, t):
        nonlocal done
        if key not in expected:
            raise ValueError(f"SRC {ckpt.path} holds {key!r}, which the {arch} checkpoint has no place for")
        writer.add(key, t)
        written.add(key)
        done += 1
        bar = int(24 * done / total)
        line = f"upcycle [{'#' * bar}{'.' * (24 - bar)}] {done}/{total} tensors  {writer.total / 2**20:,.0f} MiB"
        if tty:
            stream.write(f"\r{line}\033[K")
        elif done % every == 0 or done == total:
            stream.write(line + "\n")
        stream.flush()

    def get(key):
        return ckpt.where[key].get_tensor(key)

    for key in others:
        put(key, get(key))
    for i in moe_ids:
        put(_router_key(arch, i), router_weight(E, R, cfg.hidden, generator))
        if bias:
            put(upcycle_deepseek.router_keys(i)[1], torch.zeros(E * R, dtype=torch.float32))
        gate, up, down = (get(f"model.layers.{i}.mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
        if S:  # unscaled: the shared expert is not routed, so nothing divides its output
            for key, t in zip(upcycle_deepseek.shared_keys(i), (gate[:S * f], up[:S * f], down[:, :S * f])):
                put(key, t.clone())
        slices = list(expert_slices(gate[S * f:], up[S * f:], down[:, S * f:], R))
        for e in range(E):
            for g, parts in enumerate(slices):
                for key, t in zip(_moe_keys(arch, i, e * R + g), parts):
                    put(key, t.clone())  # each expert owns its storage (safetensors refuses shared views)
    if tty:
        stream.write("\n")
    if written != expected:
        raise ValueError(f"SRC {ckpt.path} lacks {sorted(expected - written)[:3]} for the {arch} checkpoint")
    writer.close()
