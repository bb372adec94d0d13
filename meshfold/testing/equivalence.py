"""One call that checks a model of one's own on a fold: loss and every gradient equal one device.

:func:`assert_matches_one_device` runs on every rank of a fold (inside ``World.run``, or in a
test's ``worlds(n).run``): it builds the single-device reference and the model to lay out, lays
the second out with ``parallelize`` (with ``pp > 1``: as a ``Pipeline``), runs one forward and backward of a global batch on each (the
reference on the whole batch, each rank on its slice: batch over ``dp``, sequence over
``cp x tp``, :func:`meshfold.parallel.batch.shard_batch`) and asserts that the loss and every
full gradient, under its single-device name, agree. Example (a test, 4 ranks)::

    def check(rank, world_size, spec):
        build = lambda device: init.build(lambda: MyModel(cfg), seed=0, device=device)
        return assert_matches_one_device(build, MY_PLAN, spec, (tokens, targets))

    worlds(4).run(check, FoldSpec(4, tp=2, ep=2))
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["assert_matches_one_device", "perturb_constants"]


@torch.no_grad()
def perturb_constants(model: nn.Module, seed: int, scale: float = 0.1) -> None:
    """Move every parameter that starts as a constant (norm weights at 1, biases at 0: declared
    "constant" in ``model.inits``, :mod:`meshfold.models.init`) off its initial value by
    ``scale * N(0, 1)`` noise from ``seed``, so a layout that dropped or misapplied one shows in
    the outputs, not just in its gradient. ``model.inits`` must exist (a model built with
    :func:`meshfold.models.init.build` or meshfold's own)."""
    inits = getattr(model, "inits", None)
    if inits is None:
        raise ValueError(f"perturb_constants: {type(model).__name__} records no inits; build it with "
                         f"meshfold.models.init.build or declare its tensors' initialization")
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if inits[name].kind == "constant":
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))


def _default_loss(model, tokens, targets, positions, **per_token):
    return model.loss(tokens, targets, positions, **per_token)


def assert_matches_one_device(build: Callable, plan, fold, batch: tuple, *,
                              loss: Callable | None = None, data_parallel: str = "fsdp",
                              compute_dtype: torch.dtype | None = None, recompute: str = "none",
                              on_meta: bool = False, perturb: int | None = 0,
                              rtol: float = 1e-9, atol: float = 1e-11) -> dict[str, float]:
    """Assert, on this rank, that ``build``'s model laid out on ``fold`` computes what it computes
    on one device: the loss and every parameter's full gradient. Every rank of the fold calls it
    with the same arguments (it runs collectives).

    ``build(device)``: the model (fp64 for an exact check) with the same weights on every call
    and rank, e.g. ``lambda device: init.build(lambda: MyModel(cfg), seed=0, device=device)``.
    ``plan``: the layout plan ``parallelize`` takes (None: the model's own, ``model.plan()``).
    ``fold``: a :class:`~meshfold.mesh.FoldSpec` (its cached fold is used) or a folded mesh.
    ``batch``: ``(tokens, targets)``, the global [B, S] batch, the same on every rank, or
    ``(tokens, targets, per_token)`` with ``{name: [B, S, ...]}``, the model's other per-token
    inputs (the plan's ``per_token``), each rank's slice cut as its tokens are
    (:func:`~meshfold.parallel.batch.shard_batch`) and passed as keywords.
    ``loss(model, tokens, targets, positions, **per_token)`` (default ``model.loss(tokens,
    targets, positions, **per_token)``): the mean loss; laid out, a rank's call on its slice
    returns the global mean.
    ``data_parallel``, ``compute_dtype``, ``recompute``: as ``parallelize`` takes them (with a
    compute dtype narrower than the model's, loosen ``rtol`` / ``atol``: the reference stays in
    the model's dtype). ``on_meta``: lay out ``build("meta")``, each rank materializing its own
    shards (which also checks the model's initialization is fold-independent) instead of a copy
    of the reference. ``perturb`` (seed; None: off, and always off on meta): first move the
    reference's constant-initialized parameters (:func:`perturb_constants`).

    With ``pp > 1`` the model runs as a :class:`~meshfold.parallel.pipeline.Pipeline` of one
    microbatch (its ``plan`` names the blocks, ``before`` and ``after``): the loss is the one
    ``Pipeline.step`` returns (the model's ``loss_terms``; a custom ``loss`` is refused), and each
    rank compares the gradients of its own stage; together the ranks must hold every gradient of
    one device.

    Returns ``{"loss": |difference|, "grad": the largest |difference| of any gradient element}``.
    Raises AssertionError naming the first quantity that differs.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshfold.mesh import FoldSpec
    from meshfold.parallel.batch import shard_batch
    from meshfold.parallel.data_parallel import reduce_gradients
    from meshfold.parallel.layouts import single_device_name
    from meshfold.parallel.pipeline import Pipeline
    from meshfold.parallel.transformer import parallelize
    from meshfold.testing.worlds import cached_fold

    folded = cached_fold(fold) if isinstance(fold, FoldSpec) else fold
    spec = folded.spec
    if spec.pp != 1 and loss is not None:
        raise ValueError(f"assert_matches_one_device: pp = {spec.pp} with a loss function: a pipeline computes "
                         f"the loss from the last stage's logits with the model's loss_terms; valid: loss=None")
    loss = loss or _default_loss
    tokens, targets, *rest = batch
    per_token = dict(rest[0]) if rest else {}
    device = folded.device

    ref = build(device)
    if perturb is not None and not on_meta:
        perturb_constants(ref, perturb)
    model = build("meta" if on_meta else device)
    if not on_meta:
        model.load_state_dict(ref.state_dict())
    kwargs = dict(data_parallel=data_parallel, compute_dtype=compute_dtype, recompute=recompute)
    pipe = None
    if spec.pp != 1:
        pipe = Pipeline(model, folded, 1, "gpipe", plan=plan, **kwargs)
    elif plan is None:
        parallelize(model, folded, **kwargs)
    else:
        parallelize(model, folded, plan, **kwargs)

    ref_loss = loss(ref, tokens.to(device), targets.to(device), None, **{n: t.to(device) for n, t in per_token.items()})
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    rank = dist.get_rank()
    local_tokens, pos = shard_batch(tokens, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    local_inputs = {n: shard_batch(t, spec, rank)[0].to(device) for n, t in per_token.items()}
    if pipe is not None:
        got_loss = pipe.step(local_tokens.to(device), local_targets.to(device), pos.to(device), **local_inputs)
        pipe.reduce_gradients()
        model = pipe
    else:
        got_loss = loss(model, local_tokens.to(device), local_targets.to(device), pos.to(device), **local_inputs)
        got_loss.backward()
        if data_parallel == "allreduce":
            reduce_gradients(model)
    where = f"{spec} (data_parallel={data_parallel!r}, compute_dtype={compute_dtype}, recompute={recompute!r})"
    torch.testing.assert_close(got_loss.detach().to(ref_loss.dtype), ref_loss.detach(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{where}: the loss differs from one device: {m}")
    got = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            got[single_device_name(name)] = g.full_tensor() if isinstance(g, DTensor) else g
    held = set(got)
    if pipe is not None:  # each rank holds its stage's: together they hold every gradient
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(got))
        held = set().union(*everyone)
    if held != set(ref_grads) or not set(got) <= set(ref_grads):
        raise AssertionError(f"{where}: gradients on one device only: {sorted(set(ref_grads) - held)}; "
                             f"laid out only: {sorted(held - set(ref_grads))}")
    worst = 0.0
    for name, grad in got.items():
        want = ref_grads[name]
        torch.testing.assert_close(grad.to(want.dtype), want, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{where}: the gradient of {name} differs from one device: {m}")
        worst = max(worst, (grad.to(want.dtype) - want).abs().max().item())
    return {"loss": (got_loss.detach().to(ref_loss.dtype) - ref_loss.detach()).abs().item(), "grad": worst}
