"""The optimizer of ``meshfold train``: AdamW over two parameter groups, and its learning-rate schedule.

**Schedule** (:func:`lr_at`). Step ``n`` of ``N = train.steps`` (counted from 1, as in the logs),
with ``W = train.warmup`` and ``r = train.min_lr_ratio``, runs at

* ``lr * n / W`` while ``n <= W``: a linear warm-up that reaches the peak ``lr`` at step ``W``;
* ``lr * (r + (1 - r) * (1 + cos(pi * (n - W) / (N - W))) / 2)`` after it: a cosine decay that
  ends at exactly ``lr * r`` at step ``N``.

One formula, a function of ``n``, ``N`` and the settings only: a run resumed with another
``train.steps`` continues on the schedule of the new length. A run no longer than its warm-up
(``N <= W``) ends inside the warm-up.

**Weight decay** (:func:`param_groups`). AdamW decays the matrices (every parameter with two or more
dimensions: attention and MLP weights, the experts, the embedding, the output head, the router)
and not the biases, norm gains and other one-dimensional parameters, whose scale is not a
capacity to regularise: Megatron-Core's default groups (``.bias`` and 1-D parameters), nanoGPT's
(``dim() >= 2``) and Hugging Face Trainer's (biases and norms) draw the same line for these
models. The embedding, head and routers stay decayed by default, as in all three; recipes that
exempt them (OLMo 2 exempts the embedding) name them in ``train.no_weight_decay``.

**Update.** ``torch.optim.AdamW`` with ``foreach=True``: one multi-tensor kernel per group and
dtype instead of a Python loop over the parameters. DTensor parameters (TP, EP, FSDP2 shards, on
the attention and MoE meshes alike) go through it as they are; ``tests/train/test_optim.py`` checks
that it gives the plain loop's weights bit for bit.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NO_DECAY_KINDS", "lr_at", "param_kinds", "param_groups", "build_optimizer"]

# what train.no_weight_decay may name: parameter kinds AdamW then leaves undecayed
NO_DECAY_KINDS = ("1d", "embedding", "head", "router")


def lr_at(n: int, t) -> float:
    """The learning rate of step ``n`` (1 to ``t.steps``) under ``t`` (TrainSettings: ``lr``,
    ``steps``, ``warmup``, ``min_lr_ratio``); see the module docstring."""
    if not 1 <= n <= t.steps:
        raise ValueError(f"step {n} is outside the run's steps 1..{t.steps}")
    if n <= t.warmup:
        return t.lr * n / t.warmup
    frac = (n - t.warmup) / (t.steps - t.warmup)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * frac)) / 2)


def param_kinds(name: str, param: torch.Tensor) -> set[str]:
    """The :data:`NO_DECAY_KINDS` a parameter is, from its single-device name and its (global)
    shape: ``1d`` (biases, norm gains, any vector), ``embedding`` (``embed.weight``; a head tied
    to it is this one tensor), ``head`` (``head.weight``), ``router`` (``...router.weight``)."""
    kinds = set()
    if param.dim() < 2:
        kinds.add("1d")
    if name == "embed.weight":
        kinds.add("embedding")
    if name == "head.weight":
        kinds.add("head")
    if name.endswith("router.weight"):
        kinds.add("router")
    return kinds


def param_groups(named_parameters, weight_decay: float, no_weight_decay) -> list[dict]:
    """AdamW's two groups from ``(name, parameter)`` pairs: ``decay`` (``weight_decay``) and
    ``no_decay`` (0), the latter every parameter of a kind in ``no_weight_decay``. Each group
    carries its parameters' single-device ``names``. Groups without parameters are left out."""
    from meshfold.parallel.transformer import single_device_name

    bad = sorted(set(no_weight_decay) - set(NO_DECAY_KINDS))
    if bad:
        raise ValueError(f"no_weight_decay names {bad}; valid: {', '.join(NO_DECAY_KINDS)}")
    groups = {"decay": ([], [], weight_decay), "no_decay": ([], [], 0.0)}
    for name, p in named_parameters:
        name = single_device_name(name)
        params, names, _ = groups["no_decay" if param_kinds(name, p) & set(no_weight_decay) else "decay"]
        params.append(p)
        names.append(name)
    return [{"name": g, "params": params, "names": names, "weight_decay": wd}
            for g, (params, names, wd) in groups.items() if params]


def build_optimizer(model, t, foreach: bool = True) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters (a parallelized model or a Pipeline) as ``t`` sets it:
    ``betas``, ``eps``, ``weight_decay`` and ``no_weight_decay``; ``lr`` is set per step from
    :func:`lr_at`. ``foreach=False`` is the plain per-parameter loop (the reference)."""
    groups = param_groups(model.named_parameters(), t.weight_decay, t.no_weight_decay)
    return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, foreach=foreach)
