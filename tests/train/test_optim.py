"""The optimizer as docs/config.md documents it: the learning-rate schedule, the weight-decay
groups, and AdamW's multi-tensor update against its plain loop."""

import math
from types import SimpleNamespace

import pytest

from meshfold.train.optim import build_optimizer, lr_at


def documented_lr(n: int, lr: float, steps: int, warmup: int, min_lr_ratio: float) -> float:
    """docs/config.md, written out on its own: step n of N (from 1) runs at lr * n / W during the
    warm-up (n <= W), then at lr * (r + (1 - r) * (1 + cos(pi * (n - W) / (N - W))) / 2)."""
    if n <= warmup:
        return lr * n / warmup
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * (1 + math.cos(math.pi * (n - warmup) / (steps - warmup))) / 2)


@pytest.mark.parametrize("steps, warmup", [(20, 4), (7, 1), (10, 0), (201, 20)])
def test_lr_schedule_is_the_documented_one_at_its_landmarks(steps, warmup):
    t = SimpleNamespace(lr=3e-3, steps=steps, warmup=warmup, min_lr_ratio=0.1)
    got = {n: lr_at(n, t) for n in range(1, steps + 1)}
    for n in range(1, steps + 1):
        assert got[n] == pytest.approx(documented_lr(n, t.lr, steps, warmup, 0.1), rel=1e-15, abs=0), n
    if warmup:
        assert got[1] == t.lr / warmup and got[warmup] == t.lr  # first step, the peak
        assert sum(v == t.lr for v in got.values()) == 1  # the peak runs once
    middle = warmup + (steps - warmup) / 2
    if middle == int(middle):
        assert got[int(middle)] == pytest.approx(t.lr * (0.1 + 0.9 / 2), rel=1e-15)
    assert got[steps] == pytest.approx(t.lr * 0.1, rel=1e-15, abs=0)  # exactly lr x min_lr_ratio
    assert all(got[n + 1] < got[n] for n in range(max(warmup, 1), steps))  # decays after the peak


def test_a_run_ends_inside_a_warmup_longer_than_itself():
    t = SimpleNamespace(lr=1.0, steps=4, warmup=10, min_lr_ratio=0.1)
    assert [lr_at(n, t) for n in range(1, 5)] == [0.1, 0.2, 0.3, 0.4]
    with pytest.raises(ValueError, match="step 5 is outside the run's steps 1..4"):
        lr_at(5, t)


# ---- weight decay groups ------------------------------------------------------------------------

def _groups(no_weight_decay, name="tiny-qwen2-moe", **model):
    import dataclasses

    import torch

    from meshfold.models.configs import get_config
    from meshfold.models.transformer import MoETransformer

    with torch.device("meta"):
        m = MoETransformer(dataclasses.replace(get_config(name), **model))
    t = SimpleNamespace(lr=1e-3, weight_decay=0.1, no_weight_decay=no_weight_decay, betas=[0.9, 0.95], eps=1e-8)
    opt = build_optimizer(m, t)
    return {g["name"]: (set(g["names"]), g["weight_decay"]) for g in opt.param_groups}, dict(m.named_parameters())


def test_default_groups_decay_matrices_and_exempt_every_vector():
    groups, params = _groups(["1d"])
    decay, wd = groups["decay"]
    no_decay, zero = groups["no_decay"]
    assert wd == 0.1 and zero == 0.0 and decay | no_decay == set(params) and not decay & no_decay
    assert no_decay == {n for n, p in params.items() if p.dim() == 1}
    # the vectors of this model: norm gains, q/k/v biases
    assert {n.rsplit(".", 1)[0].split(".")[-1] for n in no_decay} == {"attn_norm", "mlp_norm", "norm", "attn"}
    assert {"embed.weight", "head.weight", "layers.1.mlp.router.weight", "layers.1.mlp.shared.gate"} <= decay


@pytest.mark.parametrize("kinds, exempt", [
    ([], set()),
    (["embedding", "head"], {"embed.weight", "head.weight"}),
    (["router"], {"layers.0.mlp.router.weight", "layers.1.mlp.router.weight"}),
])
def test_no_weight_decay_names_what_is_exempt(kinds, exempt):
    groups, params = _groups(kinds, name="tiny-mixtral")
    assert groups.get("no_decay", (set(), 0))[0] == exempt
    assert groups["decay"][0] == set(params) - exempt


def test_a_tied_head_is_the_embedding():
    groups, params = _groups(["embedding"], name="tiny-mixtral", tie_embeddings=True)
    assert "head.weight" not in params and groups["no_decay"][0] == {"embed.weight"}


def test_an_unknown_parameter_kind_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"no_weight_decay names \['bias'\]; valid: 1d, embedding, head, router"):
        _groups(["bias"])


# ---- foreach against the plain loop, on a folded model ------------------------------------------

def _foreach_run(rank, world_size, spec, data_parallel):
    import torch

    import dataclasses

    from meshfold.models.configs import get_config
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from meshfold.testing.worlds import cached_fold

    t = SimpleNamespace(lr=1e-2, weight_decay=0.1, no_weight_decay=["1d"], betas=[0.9, 0.95], eps=1e-8)
    weights, names = {}, {}
    for foreach in (True, False):
        cfg = dataclasses.replace(get_config("tiny-qwen2-moe"), layers=2)  # a dense and an MoE layer
        model = MoETransformer(cfg, dtype=torch.float64, device="meta", seed=1)
        parallelize(model, cached_fold(spec), data_parallel=data_parallel)
        opt = build_optimizer(model, t, foreach=foreach)
        assert all(g["foreach"] is foreach for g in opt.param_groups)
        for step in (1, 2, 3):
            for p in model.parameters():  # a gradient of each parameter's own layout: an op of it
                p.grad = torch.sin(p.detach() * step + step)
            opt.step()
        weights[foreach] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        names[foreach] = {g["name"]: g["names"] for g in opt.param_groups}
    assert names[True] == names[False]
    return weights, names[True]


@pytest.mark.multirank
def test_foreach_adamw_gives_the_plain_loops_weights_on_a_fold(worlds):
    """AdamW's multi-tensor path over DTensor parameters on the attention and MoE meshes (FSDP2
    shards, TP, EP) updates every weight exactly as the per-parameter loop does; the groups, by
    single-device name, are the single-device model's."""
    import torch

    from meshfold.mesh import FoldSpec

    spec = FoldSpec(4, tp=2, ep=2)  # attn tp2 x dp2, moe ep2 x edp2: FSDP2 shards on both meshes
    weights, names = worlds(4).run(_foreach_run, spec, "fsdp", timeout=300)[0]
    for name, w in weights[False].items():
        assert torch.equal(weights[True][name], w), name
    single, _ = _groups(["1d"], layers=2)
    assert {g: set(n) for g, n in names.items()} == {g: n for g, (n, _) in single.items()}
