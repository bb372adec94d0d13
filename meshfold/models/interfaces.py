"""What an MoE layer asks of a router and of its experts: the plug points of :class:`MoELayer`.

Legend: T = this rank's tokens, H = hidden, E = experts (``E_l = E / ep`` of them on this rank),
k = top-k, M = rows this rank's experts receive, expert-major.

``MoELayer(cfg, router=..., experts=...)`` takes any modules that satisfy :class:`MoERouter` and
:class:`MoEExperts`; everything between them (dropping, permute, the token dispatch over ``ep`` and
``etp``, combine, the balancing losses) is the layer's own and unchanged. Both are written as
single-device code: they read each parameter through ``local(name, param)`` (:class:`LocalView`),
which is the identity on one device and, once :func:`meshfold.parallel.moe.parallelize_moe` has
laid the layer out, this rank's shard in the dtype it computes in. Read it inside ``forward``, so
module hooks (FSDP2's all-gather) see it.

What the dispatch supports: **fixed top-k**. Every token is routed to exactly ``k = cfg.topk``
(expert, weight) pairs; ``capacity_factor`` may then drop pairs (per expert, sub-sequence or
full-sequence). Expert-choice routing (each expert picks its top tokens) does not fit, for three
reasons: a token gets a variable number of experts (0 to E), which ``[T, k]`` cannot hold; the
choice is over a set of tokens, so on a fold (tokens split over dp x cp x tp) the single-device
result needs every rank's scores before any rank can route, a gather over the whole attention
mesh where meshfold's dispatch only gathers within (cp, tp) for full-sequence dropping; and a
token's experts depend on later tokens of its sequence, so an autoregressive model cannot route at
inference as it trained. The nearest supported scheme is top-k with ``capacity_factor`` and
``drop_policy="probs"`` (each expert keeps its highest-weighted pairs).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["LocalView", "MoERouter", "MoEExperts"]


class LocalView(Protocol):
    """``local(name, param) -> tensor``: this rank's view of an MoE-layer parameter.

    ``name`` is the parameter's dotted name within the MoE layer (``"router.weight"``,
    ``"experts.w_in"``): the key of the layer's layout table
    (:data:`meshfold.parallel.layouts.MOE_LAYOUT`, or the table passed to ``parallelize_moe``).
    One device: ``param`` itself. Folded: the local shard (experts over ``ep``, their ffn as the
    table says over ``etp``), with gradients that come back as Partial DTensors over every dim
    whose ranks hold other tokens, cast to the compute dtype; every parameter of the layer's
    ``router`` module keeps its own dtype instead (``parallelize_moe``'s ``keep_dtype`` says
    otherwise where given).
    """

    def __call__(self, name: str, param: torch.Tensor) -> torch.Tensor: ...


class MoERouter(Protocol):
    """A router: ``router(x_TH, local, **route_inputs) -> (probs_TK, experts_TK, logits_TE)``.

    * ``x_TH`` [T, H]: this rank's tokens, in the layer's input dtype (cast to the router's own
      dtype inside the router if it computes in another; meshfold's :class:`Router` uses
      ``cfg.router_dtype``).
    * ``local``: a :class:`LocalView` (None on one device for meshfold's :class:`Router`; the
      layer always passes one).
    * ``route_inputs``: the keyword arguments given to ``MoELayer.forward`` beyond ``x``
      (e.g. ``token_ids`` for hash routing), each tensor flattened to [T, ...] like ``x``. On a
      fold they must be sharded like the tokens (batch over dp, sequence over cp x tp): the
      token ids :func:`meshfold.parallel.shard_batch` returns already are.
    * ``probs_TK`` [T, k], floating: each pair's combine weight; gradients through it train the
      router. ``experts_TK`` [T, k] int64 in ``[0, E)``: each pair's expert. k must be
      ``cfg.topk`` (the layer checks both).
    * ``logits_TE`` [T, E] or None: the scores the balancing losses (aux, seq_aux, global_aux,
      z) are computed from; None for a router without scores (a hash router), which the layer
      accepts only when every balancing coefficient is 0.

    Every rank routes only its own tokens, so a router's parameters are laid out replicated on
    the attention mesh (``("attn", (R, R, R))`` in the layout table). Under activation
    recomputation the router runs again in backward: choices made by ``topk`` / ``sort`` are
    replayed from the forward (:mod:`meshfold.parallel.recompute`), any other choice must come out
    the same when run twice on the same inputs. Optional: ``update_expert_bias(counts_E)`` if
    the config asks for the aux-loss-free expert bias.
    """

    def __call__(self, x_TH: torch.Tensor, local: LocalView, **route_inputs
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class MoEExperts(Protocol):
    """Routed experts: ``experts(x_MH, offsets_E, local, local_mask) -> y_MH``.

    * ``x_MH`` [M, H]: the rows this rank's experts receive, expert-major (the rows of local
      expert ``e`` are ``offsets_E[e-1]:offsets_E[e]``), in the compute dtype; every etp rank of
      an ep rank gets the same rows.
    * ``offsets_E`` [E_l] int32: cumulative rows per local expert (the offsets of
      :func:`meshfold.kernels.grouped_mm`).
    * ``local``: a :class:`LocalView`; an expert weight laid out ``Shard(0)`` over ``ep``
      arrives as the [E_l, ...] slice of this rank's experts.
    * ``local_mask(name, mask)``: this rank's slice of a tile-mask buffer (meshfold's tile-sparse
      :class:`Experts`); experts without tile masks ignore it.
    * ``y_MH`` [M, H]: the experts' outputs for these rows. Under ``etp > 1`` each etp rank
      computes with its slice of the ffn, and the combine *sums* the etp ranks' outputs: so the
      experts must be an ffn whose output is the sum over ffn slices, ``down(act(up(x)))`` with
      an elementwise ``act``, ``up`` split by output columns and ``down`` by input rows (the
      layout table shards each weight's ffn dim over etp). A bias added after ``down`` would be
      counted etp times.
    """

    def __call__(self, x_MH: torch.Tensor, offsets_E: torch.Tensor, local: LocalView,
                 local_mask) -> torch.Tensor: ...
