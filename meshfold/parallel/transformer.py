"""How any model runs on a FoldedMesh: tensor, sequence, context, data and expert parallel.

The model (e.g. :mod:`meshfold.models.transformer`, or a user's own ``nn.Module``) is
single-device code. :func:`parallelize` applies, from outside, what its layout plan
(:class:`~meshfold.parallel.plan.Plan`) says, and knows no model: everything model-specific is
in the plan (meshfold's transformer's is
:func:`~meshfold.parallel.transformer_plan.transformer_plan`).

* **layout as data** (``Plan.params``; meshfold's tables :data:`~meshfold.parallel.layouts.TRANSFORMER_LAYOUT`): every dense
  parameter becomes a DTensor on the attention mesh ``(dp, cp, tp)`` of its pipeline stage; every
  MoE layer gets its table (``Plan.moe``, :data:`~meshfold.parallel.layouts.MOE_LAYOUT`) on the MoE
  mesh ``(edp, ep, etp)``. The module
  still sees plain local tensors: a parametrization returns ``to_local(grad_placements=...)`` with
  ``Partial()`` on every dim where the weight is replicated but the tokens differ, so gradients
  come back as Partial DTensors and :func:`reduce_gradients` (the data-parallel step) sums them.
* **TP with sequence parallelism**: each rank holds ``S / (cp * tp)`` tokens of a sequence. Before
  attention and the dense MLP the tokens of the tp group are all-gathered (all-gather-v over
  ``tp``); heads (``wq``/``wk``/``wv`` columns, ``wo`` rows) and the ffn are split over ``tp``; the
  outputs are reduce-scattered back. Layer norms and MoE layers run on the local tokens.
* **CP with causal load balancing**: the sequence is cut into ``2 * cp`` chunks and cp rank ``c``
  holds chunks ``c`` and ``2cp - 1 - c``, so every rank has the same amount of causal work.
  Attention is a ring (:mod:`meshfold.parallel.ring_attention`): each rank keeps its queries, K/V
  blocks travel around ``cp`` (the next in flight while this one computes), blocks are classified
  full / diagonal / future from the chunk indices on the host, and their outputs are merged by
  log-sum-exp; no [S/cp, S] mask or score tensor exists, so per-rank attention memory falls as
  1/cp. MLA rings its compressed latent instead and expands it per block
  (:class:`~meshfold.parallel.mla.LatentContext`). Positions outside that layout take the generic path: K/V all-gathered
  over ``cp`` (all-gather-v, whose backward reduce-scatters their gradients), masked by position.
* **DP**: batch over ``dp``; gradients of dense weights are summed over ``dp x cp`` (and over
  ``tp`` for weights applied to local tokens), expert weights over ``edp``. By default with FSDP2
  (``fully_shard`` in its SPMD mode): dense weights are sharded over ``dp x cp``, expert weights
  over ``edp``, all-gathered per block and reduce-scattered after backward; ``data_parallel=
  "allreduce"`` keeps whole replicas and sums in :func:`reduce_gradients`.
* **Recomputation** (``recompute``): activation checkpointing of every block
  (:mod:`meshfold.parallel.recompute`), inside the block's FSDP2 group; the recompute reissues the
  block's collectives in backward, in the same order on every rank.
* **PP**: :mod:`meshfold.parallel.pipeline` cuts the model into chunks and parallelizes each with
  this function on the rank's pipeline stage (``folded.stage``).
* **Mixed precision** (``compute_dtype``, e.g. bf16, over fp32 *master* parameters): the
  parameters, their gradients and the optimizer state stay in the master dtype; the modules see
  each parameter in the compute dtype; gradients are summed over ranks and micro-batches in at
  least fp32. With FSDP2 that is its own ``MixedPrecisionPolicy(param_dtype=compute,
  reduce_dtype=fp32)``: the all-gather runs in bf16, the reduce-scatter in fp32, and gradients
  accumulate in fp32 while gradient sync is off. The router keeps its ``router_dtype`` (its own
  FSDP group and policy). With ``"allreduce"`` PyTorch has no parameter-cast policy (DDP's is
  private and DDP cannot hold these DTensor parameters), and autocast casts per op, not for
  meshfold's own expert kernels, which take weights and inputs of one dtype: so the
  parametrization that already hands a module its local shard casts it (:class:`LocalShard`), and
  the cast's backward returns the gradient in the master dtype, where it accumulates and is
  summed. Both paths round each weight once to the compute dtype and compute the same ops.
  Under FSDP2 with ``tp > 1``, weights replicated over ``tp`` (norms, embeddings, head, the
  shared expert's gate, MLA's latent down projections ``wq_a`` / ``wkv_a``, modules of their own
  for this) are all-gathered in the master dtype and cast by the parametrization,
  because FSDP2 sums their ``tp`` shares in its param_dtype (see :func:`meshfold.parallel.data_parallel.fully_shard_folded`).

The loss each rank returns is its share (sum of its tokens' cross-entropy over the global token
count), so the shares add up to the single-device mean loss and so do the gradients.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.utils.parametrize as parametrize
from torch.utils.weak import WeakTensorKeyDictionary
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshfold.catalog import DATA_PARALLEL, check_choice
from meshfold.models.attention import CausalMaskCache
from meshfold.parallel.batch import local_positions
from meshfold.parallel.context import RingContext, gather_positions
from meshfold.parallel.data_parallel import fully_shard_folded
from meshfold.parallel.layouts import single_device_name
from meshfold.parallel.materialize import materialize_shards
from meshfold.parallel.mla import LatentContext
from meshfold.parallel.moe import FoldedComm, moe_param_layout, parallelize_moe, place
from meshfold.parallel.plan import Plan, SequenceParallel, VocabParallel, check_fold_fit, model_plan, resolve
from meshfold.parallel.recompute import apply_recompute, check_recompute
from meshfold.placements import all_gather_v, partial_grads, reduce_scatter_v, sum_statistic

__all__ = ["parallelize", "param_layouts", "model_plan", "full_state_dict", "single_device_name", "LocalShard",
           "sequence_parallel", "vocab_parallel", "GlobalLogits", "GlobalMeanLoss"]

R = Replicate()
ATTN_DIMS = ("dp", "cp", "tp")
CONTEXT = {"ring": RingContext, "latent": LatentContext}  # Plan.context value -> the hook's class


class LocalShard(nn.Module):
    """Parametrization: the module sees the local shard of its DTensor parameter, in ``dtype``
    (None: the parameter's own). The cast is autograd's ``to``, so the gradient flows back in the
    parameter's (master) dtype; under FSDP2 the shard arrives in the compute dtype already and the
    cast is a no-op. The gradient's placements follow the parameter's mesh and placements when it
    is used (:func:`~meshfold.placements.params.partial_grads`): FSDP2 may hand the module the
    parameter on another mesh than the one it was laid out on (meshfold.runtime.compat.fully_shard_over)."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype

    def forward(self, p):
        local = p.to_local(grad_placements=partial_grads(p.placements))
        return local if self.dtype is None else local.to(self.dtype)


def _gather_tokens(t: torch.Tensor, mesh, tp: int) -> torch.Tensor:
    """[B, s, ...] on each tp rank -> the tp group's [B, s * tp, ...], in tp-rank order."""
    return all_gather_v(t.transpose(0, 1).contiguous(), [t.shape[1]] * tp, mesh, "tp").transpose(0, 1)


def _scatter_tokens(y: torch.Tensor, mesh, tp: int) -> torch.Tensor:
    """[B, s * tp, ...] partial sums on each tp rank -> the sum of this rank's [B, s, ...]."""
    sizes = [y.shape[1] // tp] * tp
    return reduce_scatter_v(y.transpose(0, 1).contiguous(), sizes, mesh, "tp").transpose(0, 1)


def sequence_parallel(module: nn.Module, mesh, entry: SequenceParallel) -> None:
    """Sequence-parallel entry and exit around ``module`` (forward hooks, so its name and
    parameters stay): its input ``x`` [B, S, ...] is all-gathered over the ``tp`` dim of
    ``mesh`` along S before its forward (with the positions, if ``entry.positions``; the tables
    after them passed as None), its output [B, S * tp, ...] reduce-scattered back after it. Every
    tp rank holds the same number of tokens (the batch layout splits sequences evenly)."""
    tp = mesh.size(mesh.mesh_dim_names.index("tp"))
    what = type(module).__name__.removeprefix("Parametrized")  # parametrize's subclass: the user's class

    def enter(_, args, kwargs):
        if kwargs:
            raise ValueError(f"sequence-parallel {what} called with keyword arguments {sorted(kwargs)}; it "
                             f"takes them positionally: forward(x{', positions, *tables' if entry.positions else ''})")
        x, rest = args[0], args[1:]
        x_full = _gather_tokens(x, mesh, tp)
        if not entry.positions:
            return (x_full, *rest), {}
        if not rest or rest[0] is None:
            raise ValueError(f"sequence-parallel {what} (SequenceParallel(positions=True)) was called without "
                             f"positions; valid: forward(x, positions [S] or [B, S], *tables)")
        positions = _gathered_positions(rest[0], x.shape[1], mesh, tp)
        return (x_full, positions, *(None for _ in rest[1:])), {}

    def leave(_, args, y):
        return _scatter_tokens(y, mesh, tp)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)


_gathered = WeakTensorKeyDictionary()  # positions -> ((version, s, id(mesh)), their tp gather)


def _gathered_positions(pos: torch.Tensor, s: int, mesh, tp: int) -> torch.Tensor:
    """``pos`` [..., s] gathered over ``tp`` ([..., s * tp]), once per positions tensor (while it
    lives, unchanged in place): the layers of one forward, its recomputation and the other chunks
    of a pipeline rank receive the same positions, so they receive the same gathered tensor. One
    gather per positions tensor whatever the schedule (a step's [S] positions serve all its
    micro-batches: one gather per step), and what keys on it runs as often, not once per layer:
    ring attention's layout check (a host read off the CPU) and the causal-mask cache."""
    key = (pos._version, s, id(mesh))
    hit = _gathered.get(pos)
    if hit is not None and hit[0] == key:
        return hit[1]
    gathered = gather_positions(pos, [s] * tp, mesh, "tp")
    _gathered[pos] = (key, gathered)
    return gathered


def vocab_parallel(module: nn.Module, mesh, entry: VocabParallel) -> None:
    """:class:`~meshfold.parallel.plan.VocabParallel` around ``module`` (forward hooks; its
    ``weight``, laid out ``Shard(0)`` over ``tp``, reaches it as this rank's V / tp rows)."""
    tp_dim = mesh.mesh_dim_names.index("tp")
    tp, me = mesh.size(tp_dim), mesh.get_local_rank(tp_dim)
    what = f"vocabulary-parallel {type(module).__name__.removeprefix('Parametrized')}"  # (parametrize's subclass)
    weight = (module.parametrizations["weight"].original if parametrize.is_parametrized(module, "weight")
              else getattr(module, "weight", None))
    if not isinstance(weight, DTensor) or weight.placements[tp_dim] != Shard(0):
        raise ValueError(f"{what}: its weight must be laid out Shard(0) over tp (the vocabulary), got "
                         f"{getattr(weight, 'placements', None)}; give it (R, R, Shard(0)) in Plan.params")
    rows = weight.shape[0] // tp  # V / tp, this rank's rows [me * rows, (me + 1) * rows)
    if entry.kind == "embedding" and getattr(module, "padding_idx", None) is not None:
        raise ValueError(f"{what}: padding_idx = {module.padding_idx} is not supported (each rank holds "
                         f"other rows); valid: padding_idx=None")

    def enter(mod, args, kwargs):
        if kwargs or len(args) != 1:
            raise ValueError(f"{what} called with {len(args)} positional and {sorted(kwargs)} keyword "
                             f"arguments; valid: forward({'ids' if entry.kind == 'embedding' else 'x'})")
        x = _gather_tokens(args[0], mesh, tp)
        if entry.kind == "head":
            return (x,), {}
        local = x - me * rows
        mod._vocab_mask = (local >= 0) & (local < rows)
        return (torch.where(mod._vocab_mask, local, 0),), {}

    def leave(mod, args, y):
        if entry.kind == "embedding":
            y = y * mod._vocab_mask.unsqueeze(-1).to(y.dtype)  # other ranks' rows: zero
            del mod._vocab_mask
            return _scatter_tokens(y, mesh, tp)
        s = y.shape[1] // tp  # y: [B, s * tp, V / tp] -> every vocabulary slice, own tokens
        full = all_gather_v(y.movedim(-1, 0).contiguous(), [y.shape[-1]] * tp, mesh, "tp").movedim(0, -1)
        return full[:, me * s:(me + 1) * s]

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)


def param_layouts(model: nn.Module, folded, plan: Plan | None = None) -> dict[str, tuple]:
    """``{parameter name: (mesh, placements)}`` for every parameter of an unparallelized model:
    what :func:`parallelize` will do with ``plan`` (None: :func:`model_plan`), as data (used to
    read only each rank's checkpoint slices). Names are single-device names."""
    resolved = resolve(model, model_plan(model) if plan is None else plan)
    attn_mesh = folded.stage("attn")
    comm = FoldedComm(folded)
    out = {}
    for name, _ in model.named_parameters():
        layer = resolved.layer_of(name)
        out[name] = (moe_param_layout(name[len(layer) + 1:], comm, resolved.moe[layer]) if layer
                     else (attn_mesh, resolved.placements[name]))
    return out


def _check_divides(name: str, shape, placements, spec) -> None:
    for dim, q in zip(ATTN_DIMS, placements):
        n = getattr(spec, dim)
        if isinstance(q, Shard) and (q.dim >= len(shape) or shape[q.dim] % n):
            size = shape[q.dim] if q.dim < len(shape) else "no such dim"
            raise ValueError(f"parameter {name!r} {tuple(shape)}: Shard({q.dim}) over {dim} = {n}, but its dim "
                             f"{q.dim} is {size}; a plan shards only dims that {dim} divides")


def parallelize(model: nn.Module, folded, plan: Plan | None = None, *, local_state: dict | None = None,
                data_parallel: str = "fsdp", compute_dtype: torch.dtype | None = None,
                recompute: str = "none") -> nn.Module:
    """Lay ``model`` out on ``folded`` as ``plan`` says (None: :func:`model_plan`, the model's
    own; meshfold's models declare theirs), from identical full weights on every rank; from a
    model built on the meta device (``MoETransformer(cfg, device="meta")``), each rank then
    materializing only its own shards (TP / EP / ETP slices, then FSDP2 shards) on its device,
    with the same global values as the model built whole (:mod:`meshfold.models.init`); or,
    given ``local_state`` (``{name: this rank's shard}``, see :func:`param_layouts`), from shards
    only (the model may then live on the meta device).

    What the plan's rules do (:class:`~meshfold.parallel.plan.Plan`): ``params`` (and ``default``)
    make every parameter outside the MoE layers a DTensor on the attention mesh, seen by its
    module as the local shard (:class:`LocalShard`); ``moe`` lays each MoE layer out with its
    table (:func:`~meshfold.parallel.moe.parallelize_moe`); ``tp`` adds sequence-parallel entry /
    exit (:func:`sequence_parallel`) when tp > 1; ``context`` sets each attention module's
    ``context`` hook when cp > 1; ``recompute`` names the blocks ``recompute`` checkpoints;
    ``fsdp``, ``tp_summed`` and ``keep_dtype`` make the FSDP2 groups
    (:func:`~meshfold.parallel.data_parallel.fully_shard_folded`). The model also gets
    ``folded``, ``gather_logits`` (:class:`GlobalLogits`) and ``reduce_loss``
    (:class:`GlobalMeanLoss`), which a model's forward and loss may call.

    ``data_parallel``: ``"fsdp"`` shards every parameter over its data-parallel dims with FSDP2
    (:func:`fully_shard`; dense weights over ``dp x cp``, expert weights over ``edp``), which also
    reduces the gradients; ``"allreduce"`` keeps whole replicas and leaves the gradients Partial
    until :func:`reduce_gradients`. Either way the reduced gradients are the single-device ones.

    ``compute_dtype`` (None: the parameters' dtype): the dtype the modules compute in, e.g. bf16
    over an fp32 model, whose parameters stay the master weights (see *Mixed precision* above);
    parameters in the plan's ``keep_dtype`` (routers) keep theirs.

    ``recompute``: activation checkpointing of the plan's ``recompute`` blocks, ``"none"``,
    ``"selective"`` or ``"full"`` (:mod:`meshfold.parallel.recompute`: what each keeps and why;
    checkpoint inside each block's FSDP2 group, whose hooks unshard the weights for the recompute).

    Raises ``ValueError`` for a plan that does not fit the model (a pattern matching nothing, a
    parameter nothing places: :func:`~meshfold.parallel.plan.check_plan`) and naming the size that
    does not divide (heads, kv_heads, ffn over tp; experts over ep; expert ffn over etp; a
    sharded dim). Returns the model (modified in place).
    """
    plan = model_plan(model) if plan is None else plan
    if folded.spec.pp != 1 and plan.whole:
        raise ValueError(f"pp = {folded.spec.pp}: the plan lays out the whole {type(model).__name__}, which "
                         f"runs with pp = 1; for pipeline parallelism use meshfold.parallel.pipeline.Pipeline, "
                         f"which parallelizes each rank's model chunks")
    check_choice("data_parallel", data_parallel, DATA_PARALLEL)
    check_recompute(recompute)
    spec = folded.spec
    if plan.check is not None:
        plan.check(spec)
    r = resolve(model, plan)
    check_fold_fit(model, r, spec)
    if recompute != "none" and not r.recompute:
        raise ValueError(f"recompute = {recompute!r} but the plan names no blocks to recompute "
                         f"(Plan.recompute = {plan.recompute!r})")
    on_meta = local_state is None and any(p.is_meta for p in model.parameters())
    if on_meta and getattr(model, "inits", None) is None:
        raise ValueError("the model is on the meta device but records no initialization; build it "
                         "with meshfold.models.init.build(make, seed, device='meta') (meshfold's own: "
                         "MoETransformer(cfg, device='meta')) or pass local_state")
    attn_mesh = folded.stage("attn")
    for path, table in r.moe.items():
        prefix = path + "."
        sub = None if local_state is None else {
            n[len(prefix):]: t for n, t in local_state.items() if n.startswith(prefix)}
        layer = model.get_submodule(path)
        # the router's parameters keep their dtype (parallelize_moe's default), and so does every
        # parameter of the layer the plan's keep_dtype names
        keep = {f"router.{n}": None for n, _ in layer.router.named_parameters()}
        keep.update({n[len(prefix):]: d for n, d in r.keep.items() if n.startswith(prefix)})
        parallelize_moe(layer, folded, sub, layout=table, compute_dtype=compute_dtype, keep_dtype=keep)
    for name, placements in r.placements.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attr)
        _check_divides(name, param.shape, placements, spec)
        setattr(module, attr, place(param, attn_mesh, placements, None if local_state is None else local_state[name]))
        dtype = r.keep[name] if name in r.keep else compute_dtype
        parametrize.register_parametrization(module, attr, LocalShard(dtype), unsafe=True)
    masks = CausalMaskCache()  # generic cp path: one mask per forward for all layers
    for path, hook in r.context.items():
        if spec.cp > 1:
            model.get_submodule(path).context = CONTEXT[hook](attn_mesh, spec.cp, masks)
    for path, entry in r.tp.items():
        if spec.tp > 1:
            style = vocab_parallel if isinstance(entry, VocabParallel) else sequence_parallel
            style(model.get_submodule(path), attn_mesh, entry)
    apply_recompute([model.get_submodule(p) for p in r.recompute], recompute)
    for attr, value in (("folded", folded), ("gather_logits", GlobalLogits(attn_mesh, spec)),
                        ("reduce_loss", GlobalMeanLoss(attn_mesh))):
        if getattr(model, attr, None) is not None and attr != "folded":
            raise ValueError(f"{type(model).__name__}.{attr} is {getattr(model, attr)!r}; parallelize sets it "
                             f"(None on one device), so a model may not define it otherwise")
        setattr(model, attr, value)
    _check_loss_calls(model, spec)
    if data_parallel == "fsdp":
        fully_shard_folded(model, folded, r, compute_dtype)
    if on_meta:  # after FSDP2 has sharded: each rank allocates and draws only what it keeps
        materialize_shards(model, model.inits, model.init_seed, folded.device, name_of=single_device_name)
    return model


def _check_loss_calls(model: nn.Module, spec) -> None:
    """Wrap ``model.loss`` (if it has one) so that a call that cannot give one device's loss is an
    error on every rank (each makes the same calls, so none waits in a collective): one without
    ``positions`` on a fold with ``cp > 1`` (each rank would take its tokens for positions
    ``0..s-1``, and the cp ranks would disagree on their attention's collectives), and one that
    returns without calling ``model.reduce_loss`` (each rank would return the mean of its own
    tokens, and the gradients would not sum to one device's)."""
    loss = getattr(model, "loss", None)
    if not callable(loss):
        return
    what = f"{type(model).__name__}.loss"
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):  # no signature to read: nothing to bind positions to
        signature = None
    takes_positions = signature is not None and "positions" in signature.parameters

    def checked(*args, **kwargs):
        if spec.cp > 1 and takes_positions:
            bound = signature.bind_partial(*args, **kwargs).arguments
            if bound.get("positions") is None:
                raise ValueError(f"{what} called without positions on a fold with cp = {spec.cp}: each rank holds "
                                 f"two chunks of every sequence, so its positions are not 0..s-1; pass the "
                                 f"positions shard_batch returns: loss(tokens, targets, positions)")
        before = model.reduce_loss.calls
        out = loss(*args, **kwargs)
        if model.reduce_loss.calls == before:
            raise ValueError(f"{what} returned without calling self.reduce_loss: on a fold each rank would "
                             f"return the mean of its own tokens; end it with self.reduce_loss(total, count) "
                             f"(a cross-entropy sum and its token count, meshfold.models.transformer."
                             f"cross_entropy_sum) when reduce_loss is set (docs/models.md)")
        return out

    model.loss = checked


class GlobalLogits:
    """Local logits [b, s, V] -> DTensor on the attention mesh, placements (Shard(0), Shard(1),
    Shard(1)) over (dp, cp, tp) in natural sequence order, so ``.full_tensor()`` is the global
    [B, S, V]. Without cp, the local pieces already are that layout (a relabel, no copy). With
    cp, ranks hold mirrored chunks, so the cp x tp group all-gathers its sequence, reorders it and
    keeps its natural slice: the loss path (``model.loss``) never needs this."""

    def __init__(self, mesh, spec):
        self.mesh, self.spec = mesh, spec

    def __call__(self, logits):
        natural = (Shard(0), Shard(1), Shard(1))
        z = DTensor.from_local(logits, self.mesh, natural, run_check=False)
        if self.spec.cp == 1:
            return z
        full = z.redistribute(self.mesh, (Shard(0), R, R)).to_local()  # [b, S, V], chunk order
        S = full.shape[1]
        order = torch.cat([local_positions(S, self.spec, r) for r in self._cp_tp_ranks()])
        natural_full = torch.empty_like(full).index_copy(1, order.to(full.device), full)
        return DTensor.from_local(natural_full, self.mesh, (Shard(0), R, R),
                                  run_check=False).redistribute(self.mesh, natural)

    def _cp_tp_ranks(self):
        """Global ranks of this rank's (cp, tp) block, in (cp, tp) order."""
        me = self.spec.coords(self.mesh.get_rank())["attn"]
        return [self.spec.rank("attn", **{**me, "cp": c, "tp": t})
                for c in range(self.spec.cp) for t in range(self.spec.tp)]


class _GlobalMean(torch.autograd.Function):
    """Forward: sum of every rank's ``(loss sum, token count)`` over the attention mesh,
    divided. Backward: each rank's local sum gets ``1 / global count``, its own share (not the
    all-reduce's adjoint, which would count every rank's gradient world-size times)."""

    @staticmethod
    def forward(ctx, total, count, mesh):
        both = sum_statistic(torch.stack([total.detach().double(), count.double()]), mesh, ATTN_DIMS)
        ctx.n = both[1]
        return (both[0] / both[1]).to(total.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.n.to(grad.dtype), None, None


class GlobalMeanLoss:
    """``model.reduce_loss``: a rank's (cross-entropy sum, token count) -> the global mean."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.calls = 0  # how often a loss called it (parallelize checks that model.loss does)

    def __call__(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return _GlobalMean.apply(total, count, self.mesh)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor, under its single-device name (collective)."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[single_device_name(name)] = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    return out
