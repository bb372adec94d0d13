"""An independent reimplementation of the documented training reproduces ``meshfold train``.

``meshfold train`` trains a Hugging Face Mixtral checkpoint (``train.init_from``) in fp64 on two
folds of 4 ranks. Beside it, the same checkpoint is trained with transformers' own
``MixtralForCausalLM`` and ``torch.optim.AdamW``, written only from docs/config.md (*What a step
computes*) and the run's ``run.json``: the text split and batches, the loss, clipping, the two
weight-decay groups, AdamW's betas and eps, the learning-rate schedule, the validation loss.
Every step's loss, learning rate and gradient norm, and the validation loss, agree to fp64
rounding (benchmarks/RESULTS.md has the measured differences).

transformers computes router probabilities, RoPE angles and RMSNorm statistics in fp32 whatever
the model's dtype; meshfold's fp64 run computes all three in fp64 (``MoEConfig.router_dtype``,
``rope_cos_sin``, ``RMSNorm``), so the reference's router, rotary embedding and norms are switched
to fp64 here; everything else is transformers' code as it ships.
"""

import json
import math

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
transformers = pytest.importorskip("transformers", reason="needs transformers, a test extra: pip install -e '.[test]'")
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

STEPS = 6
SETTINGS = dict(steps=STEPS, batch=4, seq=16, warmup=2, lr=0.02, grad_clip=0.5, weight_decay=0.1,
                eval_batches=2, eval_every=1000, ckpt_every=1000, seed=3)
FOLDS = {"tp2xdp2|ep4": dict(world_size=4, tp=2, ep=4),
         "tp2xdp2|etp2xep2": dict(world_size=4, tp=2, etp=2, ep=2)}
LOSS_TOL = 1e-12  # relative; measured differences are ~1e-15


def _checkpoint(path):
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, router_jitter_noise=0.0, tie_word_embeddings=False,
                                     rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(torch.float64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # unit-scale weights, norms near 1
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.1 * r if "norm" in name else r * p.shape[-1] ** -0.5)
    model.save_pretrained(path)


def _text(path):
    rng = np.random.default_rng(0)
    words = ["def", "fold", "expert", "router", "(x):", "return", "\n", "    ", "tokens", "=", "+", "moe"]
    path.write_text(" ".join(rng.choice(words, size=3000)))


def _meshfold_run(world, out, ckpt, data, fold):
    from meshfold.train.config import load_config
    from meshfold.train.loop import train_rank
    from meshfold.train.rundir import RunLock, prepare

    sets = [f"train.{k}={v}" for k, v in SETTINGS.items()]
    sets += [f"fold.{k}={v}" for k, v in fold.items()]
    sets += ['train.dtype="float64"', f"train.init_from={json.dumps(str(ckpt))}",
             f"train.out_dir={json.dumps(str(out))}", "moe.aux_loss_coeff=0.0", "data.val_fraction=0.2"]
    cfg = load_config(None, sets)
    cfg.data.paths = [str(data)]
    run = cfg.resolve()
    with RunLock(out) as lock:
        prepare(lock, run.cfg, run.model)  # run.json, as meshfold train writes it before the ranks start
    world.run(train_rank, run, timeout=600)
    metrics = {r["step"]: r for r in map(json.loads, open(out / "metrics.jsonl"))}
    return json.loads((out / "run.json").read_text()), metrics


# ---- the reference, from docs/config.md and run.json only --------------------------------------

def _router_fp64(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), idx


def _rope_fp64(self, x, position_ids):
    dim = self.inv_freq.numel() * 2
    inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"]
                      ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    emb = (position_ids[..., None].double() * inv_freq).repeat(1, 1, 2)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rmsnorm_fp64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _batch(part, n_or_i, split, run):
    """Batch ``n - 1`` of the training part (split 0) or ``i`` of the validation part (1)."""
    seq, batch = run["train.seq"], run["train.batch"]
    starts = np.random.default_rng([run["train.seed"], n_or_i, split]).integers(0, len(part) - seq - 1, size=batch)
    rows = torch.from_numpy(np.stack([part[s:s + seq + 1] for s in starts]).astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def _mean_ce(model, tokens, targets):
    logits = model(input_ids=tokens).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _lr(n, run, steps):
    lr, w, r = run["train.lr"], run["train.warmup"], run["train.min_lr_ratio"]
    if n <= w:
        return lr * n / w
    return lr * (r + (1 - r) * (1 + math.cos(math.pi * (n - w) / (steps - w))) / 2)


def _reference(ckpt, data, recorded, monkeypatch):
    run, steps = recorded["identity"], recorded["steps"]
    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", _router_fp64)
    monkeypatch.setattr(modeling_mixtral.MixtralRotaryEmbedding, "forward", _rope_fp64)
    monkeypatch.setattr(modeling_mixtral.MixtralRMSNorm, "forward", _rmsnorm_fp64)
    model = transformers.MixtralForCausalLM.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa",
                                                          experts_implementation="eager")  # grouped_mm: no fp64
    text = np.frombuffer(data.read_bytes(), dtype=np.uint8)
    cut = int(len(text) * (1 - run["data.val_fraction"]))
    train, val = text[:cut], text[cut:]
    assert run["train.no_weight_decay"] == ["1d"]  # what the groups below implement
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": run["train.weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=run["train.lr"], betas=tuple(run["train.betas"]), eps=run["train.eps"])
    rows = {}
    for n in range(1, steps + 1):
        loss = _mean_ce(model, *_batch(train, n - 1, 0, run))
        loss.backward()
        norm = torch.sqrt(sum(p.grad.square().sum() for p in params)).item()
        if norm > run["train.grad_clip"]:
            for p in params:
                p.grad.mul_(run["train.grad_clip"] / norm)
        for group in opt.param_groups:
            group["lr"] = _lr(n, run, steps)
        opt.step()
        opt.zero_grad()
        rows[n] = {"loss": loss.item(), "lr": _lr(n, run, steps), "grad_norm": norm}
    with torch.no_grad():
        rows[steps]["val_loss"] = sum(_mean_ce(model, *_batch(val, i, 1, run)).item()
                                      for i in range(SETTINGS["eval_batches"])) / SETTINGS["eval_batches"]
    return rows


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reimplementation")
    _checkpoint(root / "ckpt")
    _text(root / "text.txt")
    return root / "ckpt", root / "text.txt"


@pytest.mark.parametrize("fold", list(FOLDS))
def test_documented_training_reimplemented_with_transformers_gives_the_same_losses(worlds, inputs, tmp_path,
                                                                                    monkeypatch, fold):
    ckpt, data = inputs
    recorded, got = _meshfold_run(worlds(4), tmp_path / "run", ckpt, data, FOLDS[fold])
    want = _reference(ckpt, data, recorded, monkeypatch)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert any(want[n]["grad_norm"] > SETTINGS["grad_clip"] for n in want)  # clipping was exercised
    worst = {}
    for n, row in want.items():
        for key, value in row.items():
            rel = abs(got[n][key] - value) / abs(value)
            worst[key] = max(worst.get(key, 0.0), rel)
            assert rel < LOSS_TOL, (fold, n, key, got[n][key], value)
    assert want[STEPS]["loss"] < want[1]["loss"] - 0.5  # the steps did train
    print(f"{fold}: largest relative differences over {STEPS} steps: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
