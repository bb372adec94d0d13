"""``meshfold upcycle``: dense Llama / Mistral / Qwen2 checkpoints into Mixtral / Qwen2-MoE ones,
and dense DeepSeek-V3 ones (MLA, every layer dense) into DeepSeek-V3 MoE ones, equal to the dense
model at initialization where the method promises it, and ``train.init_from``.

The promise (meshfold/interop/upcycle.py): coarse upcycling (G = 1) under renormalised top-k
routing gives the dense logits for *any* router; granular upcycling (G > 1) gives them whenever
each token's k*G chosen experts are k whole virtual groups, which the per-group repeated router
rows make the case for every token without exact ties. DeepSeek-V3's sigmoid router keeps both promises
(renormalised, scale 1, groups of whole copies), and with one routing group per copy whole
virtual groups are routed even when copies tie. Dense references are transformers' own
dense models; the upcycled checkpoint is read both by meshfold and by transformers' MoE class.
Weights are drawn at unit scale, so a wrong slice, scale or routing shows far above 1e-5.
"""

import io
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from meshfold.mesh import FoldSpec
from meshfold.interop.hf import from_pretrained
from meshfold.interop.upcycle import upcycle
from tests.run_here import meshfold_here as meshfold
from tests.models.test_transformer import randomize  # unit-scale weights

# transformers builds the Qwen2-MoE target's empty shared expert (zero elements, by design)
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
TOL = 1e-5  # fp32 max abs difference of logits
V, S = 256, 16
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False, attn_implementation="eager")
DENSE = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # every layer dense (first_k_dense_replace = num_hidden_layers); MLA with a q latent, ranks not powers
    # of two, YaRN with mscale != mscale_all_dim, so the copied attention config has to survive exactly
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(num_key_value_heads=4, first_k_dense_replace=2, q_lora_rank=20, kv_lora_rank=12,
                         qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10, max_position_embeddings=128,
                         rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=4.0,
                                              original_max_position_embeddings=32, beta_fast=8.0, beta_slow=1.0,
                                              mscale=0.9, mscale_all_dim=0.7))),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """``dense(kind) -> (transformers model, checkpoint folder)``, built once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cfg_cls, model_cls, kw = DENSE[kind]
            torch.manual_seed(0)
            model = model_cls(cfg_cls(**{**COMMON, **kw})).eval()
            randomize(model, seed=len(cache) + 1)
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            cache[kind] = model, path
        return cache[kind]

    return get


def tokens(B=2, seed=0):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_diffs(out, reference_logits, tok):
    """(meshfold, transformers) max abs logit difference of the checkpoint at ``out``."""
    ours = from_pretrained(out)(tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    return (ours - reference_logits).abs().max().item(), (hf(tok).logits - reference_logits).abs().max().item()


def upcycled(dense_pair, tmp_path, E, k, G, **kw):
    model, src = dense_pair
    out = tmp_path / f"moe-{E}x{k}-g{G}"
    stream = io.StringIO()
    upcycle(src, out, E, k, G, stream=stream, **kw)
    lines = stream.getvalue().splitlines()  # not a terminal: about twenty progress lines ...
    assert 1 <= len(lines) <= 21 and all(line.startswith("upcycle [") for line in lines), lines
    last = lines[-1]
    done, total = last.split("]")[1].split()[0].split("/")
    assert done == total  # ... and ended at every tensor
    return model, out


# ----------------------------------------------------------------------------- equality at init


@pytest.mark.parametrize("kind", list(DENSE))
def test_coarse_upcycle_equals_the_dense_model_for_any_router(dense, tmp_path, kind):
    model, out = upcycled(dense(kind), tmp_path, E=4, k=2, G=1)
    tok = tokens()
    with torch.no_grad():
        ref = model(tok).logits
    ours_diff, hf_diff = max_diffs(out, ref, tok)
    assert ours_diff <= TOL and hf_diff <= TOL, (ours_diff, hf_diff)
    # any router: redraw every router weight at a large scale; the output does not move
    moe = from_pretrained(out)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in moe.moe_layers():
            layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=g) * 3)
            if layer.router.expert_bias is not None:  # DeepSeek-V3's correction bias: selection only
                layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape, generator=g))
        assert (moe(tok) - ref).abs().max().item() <= TOL


def routed_experts(model, tok):
    """Each MoE layer's chosen experts [T, k] for ``tok`` (a forward hook on the routers)."""
    seen = []
    hooks = [layer.router.register_forward_hook(lambda m, i, o: seen.append(o[1].clone()))
             for layer in model.moe_layers()]
    with torch.no_grad():
        model(tok)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("kind, E, k, G, kw", [
    ("llama", 2, 1, 4, {}), ("mistral", 3, 2, 2, {}), ("qwen2", 4, 2, 3, {}),
    ("deepseek_v3", 3, 2, 2, {}),  # one routing group: plain sigmoid top-k*G
    ("deepseek_v3", 4, 2, 3, dict(n_group=2, topk_group=1)),  # group-limited: both copies from one group
    ("deepseek_v3", 4, 1, 2, dict(first_dense=1)),  # layer 0 keeps its dense MLP
    ("deepseek_v3", 3, 2, 3, dict(shared_slices=1)),  # slice 0 is the shared expert, 2 routed per copy
])
def test_granular_upcycle_equals_the_dense_model_when_whole_groups_are_routed(dense, tmp_path, kind, E, k, G, kw):
    model, out = upcycled(dense(kind), tmp_path, E, k, G, shard_bytes=100_000, **kw)  # several shards
    assert (out / "model.safetensors.index.json").exists()
    tok = tokens()
    moe = from_pretrained(out)
    S = kw.get("shared_slices", 0)
    G = G - S  # the routed slices of a copy: a virtual group
    assert moe.cfg.moe.num_experts == E * G and moe.cfg.moe.topk == k * G and moe.cfg.moe.ffn * (G + S) == 96
    assert moe.cfg.moe.shared_ffn == S * moe.cfg.moe.ffn
    assert moe.cfg.first_k_dense == kw.get("first_dense", 0) and len(moe.moe_layers()) == 2 - moe.cfg.first_k_dense
    ng, tg = kw.get("n_group", 1), kw.get("topk_group", kw.get("n_group", 1))
    if kind == "deepseek_v3":
        assert (moe.cfg.moe.num_groups, moe.cfg.moe.group_topk) == (ng, tg)
    # the routing condition: every token's k*G experts are k whole virtual groups of G slices
    for experts_TK in routed_experts(moe, tok):
        groups = experts_TK // G
        for row_groups, row in zip(groups.tolist(), experts_TK.tolist()):
            assert len(set(row_groups)) == k and sorted(row) == sorted(e * G + g for e in set(row_groups)
                                                                       for g in range(G))
            assert len({e // (E // ng) for e in row_groups}) <= tg  # the copies come from topk_group groups
    with torch.no_grad():
        ref = model(tok).logits
    ours_diff, hf_diff = max_diffs(out, ref, tok)
    assert ours_diff <= TOL and hf_diff <= TOL, (ours_diff, hf_diff)


def test_granular_equality_needs_the_per_group_router(dense, tmp_path):
    """The same granular experts under a router whose rows differ within a group split groups and
    move the logits: the virtual-group router initialization is what makes the equality hold."""
    model, out = upcycled(dense("llama"), tmp_path, E=2, k=1, G=4)
    moe, tok = from_pretrained(out), tokens()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in moe.moe_layers():
            layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=g))
        assert (moe(tok) - model(tok).logits).abs().max().item() > 1e-2


def test_deepseek_v3_one_routing_group_per_copy_routes_whole_groups_even_when_copies_tie(dense, tmp_path):
    """--n-group E --topk-group k: the group-limited router keeps k copies' groups and then
    exactly their k*G slices, so whole virtual groups are routed for every token by construction,
    ties between copies included (where plain top-k*G may split a group)."""
    E, k, G = 4, 2, 2
    model, out = upcycled(dense("deepseek_v3"), tmp_path, E, k, G, n_group=E, topk_group=k)
    moe, tok = from_pretrained(out), tokens()
    assert (moe.cfg.moe.num_groups, moe.cfg.moe.group_topk) == (E, k)
    with torch.no_grad():
        for layer in moe.moe_layers():  # copies 1 and 2 get copy 0's router row: three-way ties
            w = layer.router.weight
            w[G:3 * G] = w[0]
    for experts_TK in routed_experts(moe, tok):
        for row in experts_TK.tolist():
            copies = {e // G for e in row}
            assert len(copies) == k and sorted(row) == [c * G + g for c in sorted(copies) for g in range(G)]
    with torch.no_grad():
        assert (moe(tok) - model(tok).logits).abs().max().item() <= TOL


def _folded_logits_equal(rank, world_size, path, spec, reference):
    from meshfold.parallel.batch import shard_batch
    from meshfold.testing.worlds import cached_fold

    folded = from_pretrained(path, mesh=cached_fold(spec))
    tok = tokens(B=2 * spec.dp)
    local, pos = shard_batch(tok, spec, rank)
    with torch.no_grad():
        return (folded(local, pos).full_tensor() - reference).abs().max().item()


@pytest.mark.multirank
@pytest.mark.parametrize("spec, kind, E, k, G, kw", [
    (FoldSpec(4, tp=2, ep=4), "llama", 2, 1, 2, {}), (FoldSpec(4, cp=2, ep=2, etp=2), "qwen2", 4, 1, 1, {}),
    (FoldSpec(4, tp=2, ep=4), "deepseek_v3", 2, 1, 2, {}), (FoldSpec(4, cp=2, ep=2, etp=2), "deepseek_v3", 4, 2, 1, {}),
    (FoldSpec(4, tp=2, ep=4), "deepseek_v3", 2, 1, 3, dict(shared_slices=1)),  # the shared expert over tp
])
def test_upcycled_checkpoint_loads_folded_and_equals_the_dense_model(worlds, dense, tmp_path, spec, kind, E, k, G,
                                                                     kw):
    model, out = upcycled(dense(kind), tmp_path, E, k, G, **kw)
    with torch.no_grad():
        reference = model(tokens(B=2 * spec.dp)).logits
    diffs = worlds(4).run(_folded_logits_equal, str(out), spec, reference)
    assert max(diffs) <= TOL, diffs


# ----------------------------------------------------------------------------- training from it


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["mistral", "deepseek_v3"])
def test_training_from_an_upcycled_checkpoint_starts_at_the_dense_loss_and_lowers_it(dense, tmp_path, kind):
    from meshfold.data.corpus import load_corpus

    model, out = upcycled(dense(kind), tmp_path, E=2, k=1, G=2)  # 4 experts over the default ep = 4
    batch, seq = 4, 32
    run = tmp_path / "run"
    proc = meshfold("train", "--set", f"train.init_from={json.dumps(str(out))}", "--steps", "6", "--out-dir",
                    str(run), "--set", f"train.batch={batch}", "--set", f"train.seq={seq}", "--set",
                    "train.warmup=1", "--set", "train.eval_every=1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    # step 1's loss is measured before any update: the dense model's loss on that batch
    tok, targets = load_corpus(None, 0.05).batch("train", 0, batch, seq, 0)
    with torch.no_grad():
        dense_loss = F.cross_entropy(model(tok).logits.reshape(-1, V), targets.reshape(-1)).item()
    assert abs(rows[0]["loss"] - dense_loss) <= 1e-4, (rows[0]["loss"], dense_loss)
    assert rows[-1]["step"] == 6 and rows[-1]["loss"] < rows[0]["loss"] - 0.05, [r["loss"] for r in rows]
    # generate / export rebuild the model from the checkpoint's recorded init_from config
    from meshfold.train.trained import load_trained

    trained, _ = load_trained(str(run))
    assert trained.cfg.moe.num_experts == 4 and trained.cfg.moe.ffn == 48


def train_until_spawn(*args):
    """``meshfold train ARGS`` in this process, for settings that must fail before any rank starts."""
    from meshfold import cli

    return cli.main(["train", *args])


@pytest.mark.parametrize("setting, message", [
    ("fold.ep=8", "num_experts = 4 is not divisible by ep = 8"),  # with world_size 8 below
    ("model.layers=3", "model.layers with train.init_from"),
    ("moe.num_experts=8", "moe.num_experts with train.init_from"),
    ("fold.pp=2", "train.init_from with fold.pp = 2"),
])
def test_train_init_from_that_does_not_fit_fails_before_spawning(dense, tmp_path, capsys, setting, message):
    _, out = upcycled(dense("llama"), tmp_path, E=2, k=1, G=2)
    capsys.readouterr()
    rc = train_until_spawn("--set", f"train.init_from={json.dumps(str(out))}", "--set", setting, "--set",
                           "fold.world_size=8", "--out-dir", str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_train_init_from_names_a_tensor_that_does_not_fit(dense, tmp_path, capsys):
    _, out = upcycled(dense("llama"), tmp_path, E=2, k=1, G=2)
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "moe_intermediate_size": 24, "intermediate_size": 24}))
    capsys.readouterr()
    rc = train_until_spawn("--set", f"train.init_from={json.dumps(str(out))}", "--out-dir", str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert rc == 2 and "w1.weight' has shape [48, 64] but the config expects [24, 64]" in err, err
    assert len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("kind, args, message", [
    ("llama", ["--experts", "2", "--topk", "1", "--granularity", "5"],
     "--granularity 5 does not divide the dense ffn (intermediate_size) 96"),
    ("llama", ["--experts", "3", "--topk", "1", "--granularity", "2", "--ep", "4"],
     "E*G = 3*2 = 6 experts are not divisible by --ep 4"),
    ("llama", ["--experts", "2", "--topk", "3"], "--topk 3 exceeds --experts 2"),
    ("llama", ["--experts", "2", "--topk", "1", "--arch", "deepseek_v3"],
     "--arch deepseek_v3 needs a dense DeepseekV3ForCausalLM SRC: LlamaForCausalLM's GQA attention has no "
     "exact MLA form"),
    ("qwen2", ["--experts", "2", "--topk", "1", "--arch", "deepseek_v3"], "use --arch qwen2_moe"),
    ("qwen2", ["--experts", "2", "--topk", "1", "--arch", "mixtral"], "use --arch qwen2_moe"),
    ("llama", ["--experts", "2", "--topk", "1", "--first-dense", "1"], "--first-dense is DeepSeek-V3's"),
    ("deepseek_v3", ["--experts", "2", "--topk", "1", "--arch", "mixtral"],
     "MLA attention that target cannot hold; use --arch deepseek_v3"),
    ("deepseek_v3_moe", ["--experts", "2", "--topk", "1"], "upcycle needs a dense one (first_k_dense_replace >= 2)"),
    ("deepseek_v3", ["--experts", "2", "--topk", "1"], "routes each token to 1 expert"),
    ("deepseek_v3", ["--experts", "2", "--topk", "1", "--granularity", "2", "--shared-slices", "1"],
     "--shared-slices 1 routes each token to 1 expert"),
    ("deepseek_v3", ["--experts", "2", "--topk", "1", "--granularity", "2", "--shared-slices", "2"],
     "--shared-slices 2 must leave each copy a routed slice (valid: 0..1"),
    ("deepseek_v3", ["--experts", "2", "--topk", "2", "--first-dense", "2"], "--first-dense 2: layers before it"),
    ("deepseek_v3", ["--experts", "4", "--topk", "2", "--n-group", "3"], "--n-group 3 does not divide --experts 4"),
    ("deepseek_v3", ["--experts", "4", "--topk", "2", "--n-group", "4"], "--n-group 4 leaves 1 expert per group"),
    ("deepseek_v3", ["--experts", "4", "--topk", "2", "--n-group", "2", "--topk-group", "3"],
     "--topk-group 3 must be in 1..--n-group 2"),
    ("deepseek_v3", ["--experts", "4", "--topk", "3", "--granularity", "2", "--n-group", "2", "--topk-group", "1"],
     "--topk 3 exceeds the 2 copies in --topk-group 1 groups of 2"),
    ("moe", ["--experts", "2", "--topk", "1"], "not a dense checkpoint meshfold can upcycle"),
    ("none", ["--experts", "2", "--topk", "1"], "no config.json"),
    ("exists", ["--experts", "2", "--topk", "1"], "exists; upcycle writes a new folder"),
])
def test_bad_arguments_give_one_line_errors_and_write_nothing(dense, tmp_path, capsys, kind, args, message):
    from meshfold import cli

    out = tmp_path / "out"
    if kind in ("llama", "qwen2", "deepseek_v3", "exists"):
        src = dense("llama" if kind == "exists" else kind)[1]
    elif kind == "moe":  # an upcycled (MoE) checkpoint is not a dense one
        src = upcycled(dense("llama"), tmp_path, E=2, k=1, G=1)[1]
    elif kind == "deepseek_v3_moe":  # nor is a DeepSeek-V3 with MoE layers
        src = upcycled(dense("deepseek_v3"), tmp_path, E=2, k=1, G=2)[1]
    else:
        src = tmp_path
    if kind == "exists":
        out.mkdir()
    before = sorted(tmp_path.iterdir())
    capsys.readouterr()  # what building the dense checkpoint printed (transformers' progress bar)
    rc = cli.main(["upcycle", str(src), str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(tmp_path.iterdir()) == before  # no OUT, no partial folder beside it


def test_a_failure_while_writing_leaves_nothing_at_out(dense, tmp_path, monkeypatch):
    from meshfold.interop import upcycle as up

    calls = []

    def failing_flush(self):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        original(self)

    original = up._ShardWriter.flush
    monkeypatch.setattr(up._ShardWriter, "flush", failing_flush)
    with pytest.raises(OSError):
        upcycle(dense("llama")[1], tmp_path / "out", 2, 1, 2, shard_bytes=50_000, stream=io.StringIO())
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []
