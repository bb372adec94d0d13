"""How a MoETransformer runs on a FoldedMesh: tensor, sequence, context, data and expert parallel.

The model (:mod:`meshfold.models.transformer`) is single-device code. :func:`parallelize` applies,
from outside:

* **layout as data** (:data:`TRANSFORMER_LAYOUT`): every dense parameter becomes a DTensor on the
  attention mesh ``(dp, cp, tp)`` of its pipeline stage; every MoE layer gets
  :data:`~meshfold.parallel.layouts.MOE_LAYOUT` on the MoE mesh ``(edp, ep, etp)``. The module
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
  parametrization that already hands a module its local shard casts it (:class:`_Local`), and
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

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshfold.catalog import DATA_PARALLEL, check_choice
from meshfold.models.attention import CausalMaskCache
from meshfold.models.mla import MLA
from meshfold.models.moe import MoELayer
from meshfold.models.transformer import MoETransformer
from meshfold.parallel.batch import local_positions
from meshfold.parallel.context import _ContextAttention, gather_positions
from meshfold.parallel.data_parallel import fully_shard_folded
from meshfold.parallel.layouts import MLA_LAYOUT, TRANSFORMER_LAYOUT, single_device_name
from meshfold.parallel.materialize import materialize_shards
from meshfold.parallel.mla import LatentContext, check_mla_fold
from meshfold.parallel.moe import FoldedComm, check_moe_fold, moe_param_layout, parallelize_moe, place
from meshfold.parallel.recompute import apply_recompute, check_recompute
from meshfold.placements import all_gather_v, partial_grads, reduce_scatter_v, sum_statistic

__all__ = ["parallelize", "param_layouts", "check_fold", "full_state_dict", "single_device_name"]

R = Replicate()
ATTN_DIMS = ("dp", "cp", "tp")

def _placements(name: str):
    for suffix, placements in (MLA_LAYOUT | TRANSFORMER_LAYOUT).items():
        if name.endswith(suffix):
            return placements
    return (R, R, R)  # embeddings, norms, q/k norms, head


class _Local(nn.Module):
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


class _TensorParallel(nn.Module):
    """Sequence-parallel entry/exit around a TP-sharded attention or dense MLP."""

    def __init__(self, inner: nn.Module, mesh, tp: int, positional: bool):
        super().__init__()
        self.inner, self.mesh, self.tp, self.positional = inner, mesh, tp, positional

    def _sizes(self, n: int) -> list[int]:
        return [n] * self.tp  # every tp rank holds the same number of tokens (validated)

    def forward(self, x, positions=None, rope=None):
        B, s, H = x.shape
        sizes = self._sizes(s)
        x_full = all_gather_v(x.transpose(0, 1).contiguous(), sizes, self.mesh, "tp").transpose(0, 1)
        if self.positional:
            pos = gather_positions(positions, sizes, self.mesh, "tp")
            y = self.inner(x_full, pos, None)  # RoPE tables recomputed for the gathered tokens
        else:
            y = self.inner(x_full)
        return reduce_scatter_v(y.transpose(0, 1).contiguous(), sizes, self.mesh, "tp").transpose(0, 1)


def _moe_prefix(model, name: str) -> str | None:
    """``layers.N.mlp`` if parameter ``name`` belongs to a MoE layer, else None."""
    if ".mlp." not in name:
        return None
    prefix = name.split(".mlp.")[0] + ".mlp"
    return prefix if isinstance(model.get_submodule(prefix), MoELayer) else None


def param_layouts(model: nn.Module, folded) -> dict[str, tuple]:
    """``{parameter name: (mesh, placements)}`` for every parameter of an unparallelized model:
    what :func:`parallelize` will do, as data (used to read only each rank's checkpoint slices)."""
    attn_mesh = folded.stage("attn")
    comm = FoldedComm(folded)
    out = {}
    for name, _ in model.named_parameters():
        prefix = _moe_prefix(model, name)
        out[name] = (moe_param_layout(name[len(prefix) + 1:], comm) if prefix
                     else (attn_mesh, _placements(name)))
    return out


def check_fold(cfg, spec) -> None:
    """Raise ``ValueError`` naming the model size that does not divide over ``spec`` (a
    :class:`~meshfold.mesh.FoldSpec`): heads, kv_heads and the dense ffn over ``tp``, and the MoE
    sizes (:func:`~meshfold.parallel.moe.check_moe_fold`). Needs no mesh, so a config can
    be checked before any process starts; :func:`parallelize` runs the same checks."""
    if getattr(cfg, "mla", None) is not None:
        check_mla_fold(cfg.heads, spec.tp)
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads)):
        if n % spec.tp:
            raise ValueError(f"{what} = {n} is not divisible by tp = {spec.tp}")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.layers)) and cfg.ffn % spec.tp:
        raise ValueError(f"ffn = {cfg.ffn} is not divisible by tp = {spec.tp}")
    if cfg.moe is not None:
        check_moe_fold(cfg.moe, spec.ep, spec.etp, spec.tp)


def parallelize(model: nn.Module, folded, local_state: dict | None = None,
                data_parallel: str = "fsdp", compute_dtype: torch.dtype | None = None,
                recompute: str = "none") -> nn.Module:
    """Lay ``model`` out on ``folded``, from identical full weights on every rank; from a model
    built on the meta device (``MoETransformer(cfg, device="meta")``), each rank then
    materializing only its own shards (TP / EP / ETP slices, then FSDP2 shards) on its device,
    with the same global values as the model built whole (:mod:`meshfold.models.init`); or,
    given ``local_state`` (``{name: this rank's shard}``, see :func:`param_layouts`), from shards
    only (the model may then live on the meta device).

    ``data_parallel``: ``"fsdp"`` shards every parameter over its data-parallel dims with FSDP2
    (:func:`fully_shard`; dense weights over ``dp x cp``, expert weights over ``edp``), which also
    reduces the gradients; ``"allreduce"`` keeps whole replicas and leaves the gradients Partial
    until :func:`reduce_gradients`. Either way the reduced gradients are the single-device ones.

    ``compute_dtype`` (None: the parameters' dtype): the dtype the modules compute in, e.g. bf16
    over an fp32 model, whose parameters stay the master weights (see *Mixed precision* above);
    routers keep their ``router_dtype``.

    ``recompute``: activation checkpointing of every block, ``"none"``, ``"selective"`` or
    ``"full"`` (:mod:`meshfold.parallel.recompute`: what each keeps and why; checkpoint inside
    each block's FSDP2 group, whose hooks unshard the weights for the recompute).

    Raises ``ValueError`` naming the size that does not divide (heads, kv_heads, ffn over tp;
    experts over ep; expert ffn over etp). Returns the model (modified in place).
    """
    check_choice("data_parallel", data_parallel, DATA_PARALLEL)
    check_recompute(recompute)
    spec = folded.spec
    if spec.pp != 1 and isinstance(model, MoETransformer):
        raise ValueError(f"pp = {spec.pp}: a whole MoETransformer runs with pp = 1; for pipeline "
                         f"parallelism use meshfold.parallel.pipeline.Pipeline, which parallelizes "
                         f"each rank's model chunks")
    cfg = model.cfg
    blocks = dict(model.layers.named_children())  # ModuleList, or a pipeline chunk's ModuleDict
    check_fold(cfg, spec)
    on_meta = local_state is None and any(p.is_meta for p in model.parameters())
    if on_meta and getattr(model, "inits", None) is None:
        raise ValueError("the model is on the meta device but records no initialization; build it "
                         "with MoETransformer(cfg, device='meta') or pass local_state")
    attn_mesh = folded.stage("attn")
    for i, block in blocks.items():
        if isinstance(block.mlp, MoELayer):
            prefix = f"layers.{i}.mlp."
            sub = None if local_state is None else {
                n[len(prefix):]: t for n, t in local_state.items() if n.startswith(prefix)}
            parallelize_moe(block.mlp, folded, sub, compute_dtype=compute_dtype)
    for name, param in list(model.named_parameters()):
        if _moe_prefix(model, name):
            continue
        placements = _placements(name)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, place(param, attn_mesh, placements, None if local_state is None else local_state[name]))
        parametrize.register_parametrization(module, attr, _Local(compute_dtype),
                                             unsafe=True)
    masks = CausalMaskCache()  # generic cp path: one mask per forward for all layers
    for block in blocks.values():
        if spec.cp > 1:
            hook = LatentContext if isinstance(block.attn, MLA) else _ContextAttention  # MLA rings its latent
            block.attn.context = hook(attn_mesh, spec.cp, masks)
        if spec.tp > 1:
            block.attn = _TensorParallel(block.attn, attn_mesh, spec.tp, positional=True)
            if not isinstance(block.mlp, MoELayer):
                block.mlp = _TensorParallel(block.mlp, attn_mesh, spec.tp, positional=False)
    apply_recompute(blocks.values(), recompute)
    model.folded = folded
    model.gather_logits = _GlobalLogits(attn_mesh, spec)
    model.reduce_loss = _GlobalMeanLoss(attn_mesh)
    if data_parallel == "fsdp":
        fully_shard_folded(model, folded, compute_dtype)
    if on_meta:  # after FSDP2 has sharded: each rank allocates and draws only what it keeps
        materialize_shards(model, model.inits, model.init_seed, folded.device, name_of=single_device_name)
    return model


class _GlobalLogits:
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


class _GlobalMeanLoss:
    """``model.reduce_loss``: a rank's (cross-entropy sum, token count) -> the global mean."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return _GlobalMean.apply(total, count, self.mesh)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor, under its single-device name (collective)."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[single_device_name(name)] = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    return out
