"""Data parallelism of a folded model: FSDP2 groups and policies over the folded mesh's data dims,
the all-reduce alternative (:func:`reduce_gradients`), and the global gradient norm.

Used by :func:`meshfold.parallel.transformer.parallelize` (``data_parallel="fsdp"`` calls
:func:`fully_shard_folded`) and by training loops (``reduce_gradients`` after backward, a no-op
for gradients FSDP2 already reduce-scattered; ``grad_norm`` for clipping).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshfold.runtime.compat import fully_shard_over
from meshfold.parallel.layouts import single_device_name
from meshfold.placements import sum_in_place

__all__ = ["REDUCE_BUCKET_BYTES", "reduce_dtype", "expert_shard_placement", "fully_shard_folded", "reduce_gradients", "grad_norm",
           "hold_fsdp_gradients", "reduce_fsdp_gradients"]


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients of ``dtype`` parameters are summed in: at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def expert_shard_placement(param, edp: int):
    """Which dim FSDP2 shards an expert weight over ``edp``: dim 0 (its local experts) when edp
    divides their count, else the first dim no other mesh dim splits that edp divides (the
    hidden size). FSDP2 cuts dim 0 in torch.chunk pieces padded to the first: one local expert
    (Mixtral at ep = 8) over edp = 2 left edp rank 0 holding it whole and both collectives
    moving twice the shard (benchmarks/RESULTS.md, "Planner against the dry run")."""
    from torch.distributed.tensor import Shard

    split = {q.dim for q in getattr(param, "placements", ()) if isinstance(q, Shard)}
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.shape[0] % edp == 0:
        return Shard(0)
    for d in range(1, param.ndim):
        if d not in split and param.shape[d] % edp == 0:
            return Shard(d)
    return Shard(0)


def fully_shard_folded(model: nn.Module, folded, resolved, compute_dtype: torch.dtype | None = None) -> None:
    """FSDP2 over the folded mesh's data-parallel dims, as a plan says (``resolved``, a
    :class:`~meshfold.parallel.plan.Resolved` plan): every module of its ``fsdp`` rules is a group,
    bottom-up (a group holds the parameters under it that no deeper group holds), the root the
    rest. A group lives on the mesh its parameters do: attention weights are sharded over
    ``dp x cp``, expert weights (the MoE mesh) over ``edp`` (:func:`expert_shard_placement`); a
    group holding both is an error naming one of each.

    Parameters are already DTensors on the whole stage mesh with ``Replicate`` on the data dims,
    which is FSDP2's SPMD mode (``dp_mesh_dims``; :func:`meshfold.runtime.compat.fully_shard_over` has the
    fallback for torch < 2.13): it shards them further, all-gathers before each
    group's forward and backward, and reduce-scatters the gradients, turning our ``Partial``
    gradient placements into sums (non-data dims such as ``tp`` for norms are all-reduced
    first). The loss is already a global mean split into per-rank shares, so gradients are summed,
    not averaged: divide factor 1, plain sum reduction.

    Mixed precision is FSDP2's ``MixedPrecisionPolicy``: parameters all-gathered and computed in
    ``compute_dtype``, gradients reduce-scattered (and, with gradient sync off, accumulated) in
    :func:`reduce_dtype` of the master dtype, then kept in the master dtype. The module of a
    ``keep_dtype`` parameter whose dtype differs from the compute or the master dtype (a router
    under bf16) is a group of its own with a policy of that dtype (FSDP2 groups hold one dtype, and
    the enclosing group's policy would cast it); its other parameters must be kept too.
    Weights replicated over tp get tp sums of gradients (norms, embeddings, head, a shared
    expert's gate, MLA's latent down projections and norms). FSDP2 adds those shares in its
    param_dtype before the reduce-scatter, so under mixed precision with tp > 1 the plan's
    ``tp_summed`` modules are groups of their own and they and the root are all-gathered in the
    master dtype instead, cast for compute by the parametrization
    (:class:`~meshfold.parallel.transformer.LocalShard`), whose backward hands FSDP2 master-dtype
    gradients: the tp sum runs in fp32 too.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, register_fsdp_forward_method

    attn, moe = folded.stage("attn"), folded.stage("moe")

    def policy(master: torch.dtype, compute: torch.dtype | None) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=compute or master, reduce_dtype=reduce_dtype(master))

    params = {single_device_name(n): p for n, p in model.named_parameters()}
    kept = resolved.keep
    master = next((p.dtype for n, p in params.items() if n not in kept), next(iter(params.values())).dtype)
    mp = policy(master, compute_dtype)
    tp_summed = folded.spec.tp > 1 and compute_dtype not in (None, master)
    wide = MixedPrecisionPolicy(param_dtype=master, reduce_dtype=reduce_dtype(master),
                                cast_forward_inputs=False) if tp_summed else mp
    groups = dict.fromkeys(resolved.fsdp, mp) | (dict.fromkeys(resolved.tp_summed, wide) if tp_summed else {})
    for name, dtype in kept.items():
        dtype = dtype or params[name].dtype
        if dtype != master or dtype != (compute_dtype or master):  # e.g. an fp32 router under bf16
            path = name.rpartition(".")[0]
            others = [n for n in params if n.startswith(path + ".") and n not in kept] if path else [""]
            if others:
                raise ValueError(f"parameter {name!r} keeps {dtype} (Plan.keep_dtype), so its module "
                                 f"{path or '<root>'!r} is an FSDP2 group of that dtype, but it also holds "
                                 f"{others[0] or 'the whole model'!r}, which is not kept; give the kept "
                                 f"parameters a module of their own")
            groups[path] = policy(dtype, dtype)
    grouped: set[int] = set()
    plans = []  # (path, module, on the MoE mesh) of every group, deepest first, the root last; decided
    for path in sorted(groups, key=lambda p: -p.count(".")) + [""]:  # before fully_shard replaces parameters
        module = model.get_submodule(path)
        own = [(f"{path}.{n}" if path else n, p) for n, p in module.named_parameters() if id(p) not in grouped]
        if not own and path:
            raise ValueError(f"FSDP2 group {path!r} (Plan.fsdp / tp_summed / keep_dtype) holds no parameter "
                             f"that a nested group does not hold")
        on: dict = {}  # mesh -> the first parameter on it
        for n, p in own:
            on.setdefault(id(p.device_mesh), (n, p.device_mesh))
        if len(on) > 1 or (own and all(m not in (attn, moe) for _, m in on.values())):
            where = ", ".join(f"{single_device_name(n)!r} on {m.mesh_dim_names}" for n, m in on.values())
            raise ValueError(f"FSDP2 group {path or '<root>'!r} holds parameters on different meshes ({where}); "
                             f"a group shards over one mesh's data dims: make the MoE layers' experts "
                             f"groups of their own (Plan.fsdp)")
        plans.append((path, module, bool(own) and next(iter(on.values()))[1] == moe))
        grouped.update(id(p) for _, p in own)
    for path, module, experts in plans:
        if experts:
            fully_shard_over(module, moe, ("edp",), mp_policy=groups.get(path, mp),
                             shard_placement_fn=lambda p: expert_shard_placement(p, folded.spec.edp))
        else:
            fully_shard_over(module, attn, ("dp", "cp"), mp_policy=groups[path] if path else wide)
    for method in ("loss", "loss_parts", "local_logits"):  # entry points besides forward: gather the root's weights too
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def _dtensor_params(model):
    return [p for p in model.parameters() if isinstance(p, DTensor)]


def hold_fsdp_gradients(model: nn.Module) -> None:
    """Keep an FSDP2 model's gradients unreduced, and its gathered parameters gathered, through
    the backwards that follow, until :func:`reduce_fsdp_gradients`: what micro-batches in turns
    need (``train.a2a_overlap``), where two backwards, and a forward beside a backward, run through
    the same blocks at once, so no one of them may reshard a block or reduce its gradients. The
    same settings torch's pipeline stages use for every backward but the reduction."""
    model.set_is_last_backward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)


def reduce_fsdp_gradients(model: nn.Module) -> None:
    """Reduce-scatter the gradients :func:`hold_fsdp_gradients` held and reshard every block, as
    torch's pipelining does after its last micro-batch (``PipelineStage.perform_reduce_grad``: the
    post-backward of each parameter group, then FSDP2's end-of-backward callback)."""
    from torch.distributed.fsdp import fully_shard

    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    state = fully_shard.state(model)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


REDUCE_BUCKET_BYTES = 16 * 2**20  # gradient bytes per all-reduce: bounds the step's extra memory


@torch.no_grad()
def reduce_gradients(model: nn.Module) -> None:
    """Data-parallel step: turn every Partial gradient into the parameter's own placements.

    Gradients that are partial over the same mesh dims are all-reduced together, in buckets of
    about ``REDUCE_BUCKET_BYTES`` (a larger gradient is summed alone, in place): one all-reduce
    per bucket and dim instead of one per parameter, and the sums are copied back into the
    gradients' own storage, so the step holds at most one bucket beyond the gradients (one flat
    buffer of all of them would hold every gradient twice for a moment). Sums run in
    :func:`reduce_dtype` (at least fp32): bf16 gradients are summed in an fp32 bucket.
    """
    buckets: dict = {}
    for p in _dtensor_params(model):
        if p.grad is None:
            continue
        g = p.grad
        dims = tuple(i for i, q in enumerate(g.placements) if isinstance(q, Partial))
        if dims:  # none: already reduced (FSDP2's reduce-scatter)
            buckets.setdefault((id(p.device_mesh), dims), []).append(p)
    for (_, dims), params in buckets.items():
        mesh = params[0].device_mesh
        names = [mesh.mesh_dim_names[i] for i in dims if mesh.size(i) > 1]  # none: nothing to sum
        locals_ = [p.grad.to_local() for p in params]
        for run in _by_size(locals_, REDUCE_BUCKET_BYTES) if names else []:
            bucket = locals_[run]
            wide = reduce_dtype(bucket[0].dtype)
            alone = len(bucket) == 1 and bucket[0].is_contiguous() and bucket[0].dtype == wide  # in place
            flat = bucket[0] if alone else torch.cat([t.reshape(-1) for t in bucket]).to(wide)
            sum_in_place(flat, mesh, names)
            if not alone:
                for t, part in zip(bucket, torch.split(flat, [t.numel() for t in bucket])):
                    t.copy_(part.view_as(t))
        for p, t in zip(params, locals_):
            p.grad = DTensor.from_local(t, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _by_size(tensors: list[torch.Tensor], limit: int) -> list[slice]:
    """``tensors`` in order, cut into runs of at most ``limit`` bytes (a larger one alone)."""
    runs, start, size = [], 0, 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if i > start and size + n > limit:
            runs.append(slice(start, i))
            start, size = i, 0
        size += n
    return runs + [slice(start, len(tensors))] if tensors else runs


@torch.no_grad()
def grad_norm(model: nn.Module) -> torch.Tensor:
    """Global L2 norm of all (reduced) gradients, each element counted once (``model``: a
    parallelized model or a Pipeline, anything with ``folded``)."""
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            replicas = 1
            for i, q in enumerate(g.placements):
                if isinstance(q, Replicate):
                    replicas *= g.device_mesh.size(i)
            total += g.to_local().double().square().sum() / replicas
        else:
            total += g.double().square().sum() / model.folded.spec.world_size
    return sum_in_place(total, model.folded.attn).sqrt()  # over every rank
