"""The MoE layer: route, dispatch, experts, combine, plus shared experts and balancing losses.

Legend: B = sequences, S = sequence length (this rank's slice), T = B*S tokens on this rank,
H = hidden, E = experts, k = top-k, N = routed rows, M = rows this rank's experts receive.

Written as single-device code: ``MoELayer(cfg)`` runs on one device. Laid out from outside by
:func:`meshfold.parallel.moe.parallelize_moe`, it runs folded: each rank passes its own tokens
(batch over dp, sequence over cp and, with sequence parallelism, over tp) and gets them back in
the same layout. The only difference is the ``comm`` object the layer asks for what depends on
the ranks (:class:`~meshfold.models.comm.MoEComm`: :class:`~meshfold.models.comm.LocalComm` here,
:class:`~meshfold.parallel.moe.FoldedComm` once laid out).

Plug points: ``MoELayer(cfg, router=..., experts=...)`` takes a router and experts of the user's
own instead of meshfold's :class:`~meshfold.models.router.Router` and
:class:`~meshfold.models.experts.Experts`; what they must do is written in
:mod:`meshfold.models.interfaces` (:class:`~meshfold.models.interfaces.MoERouter`,
:class:`~meshfold.models.interfaces.MoEExperts`: fixed top-k, and why expert-choice routing does not
fit). A router may take inputs besides the tokens (token ids for hash routing): keyword arguments
of :meth:`MoELayer.forward` reach it, each tensor flattened to [T, ...] like ``x``.

The pieces, one file each: :mod:`.router` (top-k routing), :mod:`.dispatcher` (dropping,
permute / unpermute), :mod:`.experts`, :mod:`.token_stats` (the counts and their reductions over
the attention dims) and :mod:`.balancing` (the losses, attached as each rank's share, so a DP
gradient sum gives the single-device gradient). ``last_losses`` holds the full loss values
(weighted by their coefficients), ``last_metrics`` tokens per expert, dropped fraction and load
imbalance, of the last forward; :meth:`MoELayer.step_metrics` the same over every training forward
since :meth:`MoELayer.reset_step` (all micro-batches of a step).

Micro-batches. The balancing losses are defined per forward, on that forward's tokens (one
micro-batch). A step of ``m`` micro-batches sets ``balancing_scale = 1 / m`` (gradient
accumulation, a pipeline schedule), so each micro-batch's losses enter the backward scaled by
``1 / m`` and the step's balancing gradient is the mean over its micro-batches, as Megatron-Core
scales them (``MoEAuxLossAutoScaler.set_loss_scale`` with ``1 / num_microbatches``): its size
does not grow with the micro-batch count. Losses that average over tokens or sequences (z, seq_aux)
then give the gradients of the whole batch exactly, for any ``m``.
"""

from __future__ import annotations

import torch
from torch import nn

from meshfold.models.balancing import attach_loss, balancing_loss_shares
from meshfold.models.comm import LocalComm, MoEComm
from meshfold.models.config import MoEConfig
from meshfold.models.dispatcher import drop_pairs, permute, unpermute
from meshfold.models.experts import Experts, SharedExpert
from meshfold.models.router import Router
from meshfold.models.token_stats import routing_metrics, token_stats

__all__ = ["MoELayer", "add_step_entries"]


def _per_token(name: str, value, token_shape: torch.Size):
    """A router input flattened like the tokens: a tensor [*token_shape, ...] -> [T, ...];
    anything else unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    n = len(token_shape)
    if tuple(value.shape[:n]) != tuple(token_shape):
        raise ValueError(f"router input {name!r} has shape {tuple(value.shape)}; a tensor router input "
                         f"is per token: its leading dims must be x's token dims {tuple(token_shape)}")
    return value.reshape(-1, *value.shape[n:])


def _check_routing(probs_TK, experts_TK, logits_TE, T: int, cfg: MoEConfig) -> None:
    """The router's outputs are what the dispatch takes (:class:`~meshfold.models.interfaces.
    MoERouter`): k = cfg.topk pairs per token, int64 experts, floating weights; logits [T, E]
    unless no balancing loss needs them. Shapes and dtypes only: no host read."""
    want = (T, cfg.topk)
    if tuple(experts_TK.shape) != want or experts_TK.dtype != torch.int64:
        raise ValueError(f"the router returned experts_TK {tuple(experts_TK.shape)} {experts_TK.dtype}; "
                         f"the dispatch takes fixed top-k: [T, k] = {list(want)} torch.int64")
    if tuple(probs_TK.shape) != want or not probs_TK.is_floating_point():
        raise ValueError(f"the router returned probs_TK {tuple(probs_TK.shape)} {probs_TK.dtype}; "
                         f"valid: [T, k] = {list(want)}, floating")
    if logits_TE is None:
        if cfg.any_aux_loss or cfg.z_loss_coeff:
            raise ValueError("the router returned no logits_TE (None), but the config has a balancing "
                             "loss (aux / seq_aux / global_aux / z coefficient > 0) computed from them; "
                             "return [T, E] scores or set those coefficients to 0")
    elif tuple(logits_TE.shape) != (T, cfg.num_experts):
        raise ValueError(f"the router returned logits_TE {tuple(logits_TE.shape)}; valid: [T, E] = "
                         f"{[T, cfg.num_experts]} or None")


def add_step_entries(total: tuple | None, entry: tuple) -> tuple:
    """``total + entry`` of two (loss shares {name: tensor}, routed [E], kept [E]) tuples, as a
    new tuple (``total`` None: ``entry``)."""
    if total is None:
        return entry
    shares = {name: v + entry[0][name] for name, v in total[0].items()}
    return shares, total[1] + entry[1], total[2] + entry[2]


class MoELayer(nn.Module):
    """One MoE block: ``forward(x [B, S, H] or [T, H], **route_inputs) -> same shape as x``.

    ``router`` / ``experts``: modules of the user's own (:class:`~meshfold.models.interfaces.
    MoERouter`, :class:`~meshfold.models.interfaces.MoEExperts`), used as given (``dtype`` only
    applies to what the layer builds itself); None builds meshfold's ``Router(cfg)`` /
    ``Experts(...)`` from ``cfg``. ``cfg`` still describes the routing the layer does around
    them: ``num_experts``, ``topk``, dropping, the balancing losses, shared experts.

    :func:`meshfold.parallel.moe.parallelize_moe` lays it out on a folded mesh (its parameters
    become DTensors as ``meshfold.parallel.layouts.MOE_LAYOUT`` says, or the layout table given for
    parameters of the user's own, and ``comm`` a :class:`~meshfold.parallel.moe.FoldedComm`); every
    rank must build the layer with identical initial weights (e.g. the same ``torch.manual_seed``).

    ``fused_rows`` (False; :func:`meshfold.parallel.compile.compile_model` sets it, for
    ``train.compile``): the dropless permute's backward and the combine run as compiled one-pass
    loops on CPU (:mod:`meshfold.kernels.combine`); the same values up to the order of a sum.
    """

    fused_rows = False

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype | None = None, *,
                 router: nn.Module | None = None, experts: nn.Module | None = None):
        super().__init__()
        for what, module in (("router", router), ("experts", experts)):
            if module is not None and not isinstance(module, nn.Module):
                raise TypeError(f"MoELayer({what}=...) takes an nn.Module (its parameters become the "
                                f"layer's), got {type(module).__name__}")
        if experts is not None and cfg.expert_sparsity is not None:
            raise ValueError("MoEConfig.expert_sparsity adds tile masks to meshfold's Experts; with "
                             "experts=... of your own, set expert_sparsity=None")
        self.cfg = cfg
        self.router = Router(cfg) if router is None else router
        self.experts = (Experts(cfg.num_experts, cfg.hidden, cfg.ffn, cfg.expert_kind, dtype)
                        if experts is None else experts)
        self.shared = SharedExpert(cfg.hidden, cfg.shared_ffn, cfg.shared_kind, dtype) if cfg.shared_ffn else None
        if cfg.expert_sparsity is not None:
            self.experts.add_tile_masks(cfg.expert_sparsity)
        self.comm: MoEComm = LocalComm()
        self._loss_shares: dict[str, torch.Tensor] = {}
        self._loss_totals: dict[str, torch.Tensor] | None = {}
        self.last_metrics: dict[str, torch.Tensor] = {}
        self._bias_counts = None
        self.balancing_scale = 1.0  # 1 / micro-batches of the step (module docstring)
        # (scaled loss shares, routed [E], kept [E]) of the last training forward, and summed over
        # the training forwards since reset_step; replaced, never changed in place (recompute)
        self._step_entry: tuple | None = None
        self._step: tuple | None = None

    def forward(self, x: torch.Tensor, **route_inputs) -> torch.Tensor:
        """``route_inputs``: keyword arguments for the router (e.g. ``token_ids`` [B, S]); each
        tensor's leading dims must be x's token dims, and it reaches the router flattened to
        [T, ...]; other values pass unchanged. On a fold, pass this rank's slice, laid out like
        its tokens."""
        cfg, comm = self.cfg, self.comm
        shape = x.shape
        B, S = (shape[0], shape[1]) if x.dim() == 3 else (1, shape[0])
        x_TH = x.reshape(-1, shape[-1])
        T = x_TH.shape[0]
        extra = {name: _per_token(name, value, shape[:-1]) for name, value in route_inputs.items()}
        probs_TK, experts_TK, logits_TE = self.router(x_TH, comm.local, **extra)
        _check_routing(probs_TK, experts_TK, logits_TE, T, cfg)

        keep_TK, pad_to = drop_pairs(experts_TK, probs_TK, cfg, comm)
        stats = token_stats(experts_TK, keep_TK, B, S, cfg.num_experts, bool(cfg.seq_aux_loss_coeff), comm)
        losses = balancing_loss_shares(logits_TE, stats, B, S, comm.dp, cfg)
        scale = self.balancing_scale
        for value in losses.values():
            probs_TK = attach_loss(probs_TK, value if scale == 1 else value * scale)
        # kept here too: the layer's own attribute may be another micro-batch's by the end of this
        # forward (micro-batches in turns, meshfold.runtime.overlap)
        loss_shares = {name: v.detach() for name, v in losses.items()}
        self._loss_shares, self._loss_totals = loss_shares, None

        # rows in slot order (the expert placement and its copies; by default each expert's own id)
        perm = permute(x_TH, comm.slot_ids(experts_TK), probs_TK, comm.num_slots(cfg.num_experts), keep_TK,
                       pad_to, read_counts=comm.read_counts, fused=self.fused_rows)
        # folded: the all-to-all travels...
        in_flight = comm.dispatch_start(perm.x_NH, perm.counts_E, perm.counts_read)
        shared_TH = None if self.shared is None else self.shared(x_TH, comm)  # ...while this computes
        routed = in_flight.wait()  # folded: routed.tokens, a RaggedTensor on moe (ep, etp)
        y_MH = self.experts(routed.rows, routed.offsets_E, comm.local, comm.local_mask)
        y_NH = comm.combine(routed, y_MH)
        y_TH = unpermute(y_NH, perm, T)

        if shared_TH is not None:
            y_TH = y_TH + shared_TH
        self.last_metrics = routing_metrics(stats)
        if self.training:  # evaluation forwards do not steer the aux-loss-free bias, nor count in the step
            seen = self._bias_counts
            self._bias_counts = stats.routed_all if seen is None else seen + stats.routed_all
            shares = {name: v * scale for name, v in loss_shares.items()}
            self._step_entry = (shares, stats.routed_all, stats.kept_all)
            self._step = add_step_entries(self._step, self._step_entry)
        return y_TH.reshape(shape)

    def sparse_layers(self) -> dict:
        """The experts' ``{name: (weight, mask)}`` for ``meshfold.train.sparsity.TilePruner``
        (:meth:`Experts.sparse_layers`). Single device: under ETP each rank would prune its
        shard with its own threshold."""
        if self.cfg.expert_sparsity is None:
            raise ValueError("sparse_layers needs MoEConfig(expert_sparsity=ExpertSparsity(...))")
        return self.experts.sparse_layers()

    @property
    def last_losses(self) -> dict[str, torch.Tensor]:
        """The last forward's balancing losses (coefficient-weighted), summed over every rank's
        share. On a folded layer reading it is a collective (one fused all-reduce per attention
        dim, only the first time): every rank must read it."""
        if self._loss_totals is None:
            names = list(self._loss_shares)
            if names:
                total = self.comm.sum(torch.stack([self._loss_shares[n].double() for n in names]),
                                      ("dp", "cp", "tp"))
                self._loss_totals = dict(zip(names, total.unbind()))
            else:
                self._loss_totals = {}
        return self._loss_totals

    def reset_step(self) -> None:
        """Start a new step for :meth:`step_metrics` (forget the forwards counted so far)."""
        self._step = None

    @torch.no_grad()
    def step_metrics(self) -> dict:
        """The step's balancing losses and routing, over every training forward since
        :meth:`reset_step`: ``losses`` {name: the coefficient-weighted loss as it entered the
        gradient, i.e. the mean over micro-batches}, ``tokens_per_expert`` [E] (every routed pair
        of the step, before dropping) and ``dropped_fraction`` (of those pairs). A collective on
        a folded layer, like :attr:`last_losses`: every rank must call it."""
        if self._step is None:
            raise RuntimeError("step_metrics: no training forward since reset_step")
        shares, routed_E, kept_E = self._step
        losses = {}
        if shares:
            total = self.comm.sum(torch.stack([v.double() for v in shares.values()]), ("dp", "cp", "tp"))
            losses = dict(zip(shares, total.unbind()))
        return {"losses": losses, "tokens_per_expert": routed_E,
                "dropped_fraction": 1.0 - kept_E.sum() / routed_E.sum().clamp(min=1)}

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: move the expert bias from the token counts of every forward
        since the last update (already summed over dp x cp x tp), then reset them."""
        if self._bias_counts is None:
            raise RuntimeError("update_expert_bias: no forward since the last update")
        if not hasattr(self.router, "update_expert_bias"):
            raise TypeError(f"update_expert_bias: the router ({type(self.router).__name__}) has no "
                            f"update_expert_bias(counts_E) method")
        self.router.update_expert_bias(self._bias_counts)
        self._bias_counts = None

    def discard_bias_counts(self) -> None:
        """Forget the token counts gathered since the last bias update (e.g. a skipped step)."""
        self._bias_counts = None
