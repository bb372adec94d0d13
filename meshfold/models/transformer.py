"""A decoder-only MoE transformer, written as single-device code.

Legend: B = sequences, S = sequence length (this rank's tokens), H = hidden, V = vocab.

Pre-norm blocks ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))`` where ``mlp`` is a
dense SwiGLU :class:`~meshfold.models.layers.MLP` or a :class:`~meshfold.models.moe.MoELayer`
(pattern from :class:`TransformerConfig`). Parallel layouts are applied from outside; nothing
here talks to a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models import init
from meshfold.models.attention import Attention, rope_cos_sin
from meshfold.models.config import MoEConfig
from meshfold.models.layers import MLP, RMSNorm
from meshfold.models.mla import MLA, MLAConfig, mla_rope_cos_sin
from meshfold.models.moe import MoELayer
from meshfold.models.mtp import MTPDepth, depth_inputs, mtp_objective, mtp_targets

__all__ = ["TransformerConfig", "Block", "MoETransformer", "run_blocks", "run_layers", "cross_entropy_sum"]


@dataclass
class TransformerConfig:
    """Shapes and options of the whole model.

    ``moe`` (None = dense model) describes every MoE layer; layer ``i`` is MoE iff
    ``i >= first_k_dense and (i - first_k_dense) % moe_every == 0``; other layers use the dense
    SwiGLU MLP of size ``ffn``. ``kv_heads`` defaults to ``heads`` (no GQA), ``head_dim`` to
    ``hidden // heads``. ``max_seq`` is informational (RoPE tables are computed per call).
    ``mla`` (None: grouped-query attention) makes every layer's attention multi-head latent
    attention (:class:`~meshfold.models.mla.MLA`, DeepSeek-V2/V3), with its own head dims.
    ``mtp_depth`` (D, 0 = none) adds D multi-token-prediction depths after the last layer
    (:mod:`meshfold.models.mtp`, DeepSeek-V3), each with one block of the kind layer
    ``layers + k - 1`` would have; ``mtp_loss_weight`` is their weight in the objective
    ``L_main + mtp_loss_weight / D * sum_k L_k``.
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int = 0
    moe: MoEConfig | None = None
    moe_every: int = 1
    first_k_dense: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_seq: int = 4096
    mla: MLAConfig | None = None
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.head_dim is None and isinstance(self.hidden, int) and isinstance(self.heads, int) \
                and self.heads >= 1:
            self.head_dim = self.hidden // self.heads
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "moe_every", "max_seq"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"TransformerConfig.heads = {self.heads} must be a multiple of kv_heads = "
                             f"{self.kv_heads} (valid kv_heads: "
                             f"{[g for g in range(1, self.heads + 1) if self.heads % g == 0]})")
        if self.head_dim % 2:
            raise ValueError(f"TransformerConfig.head_dim = {self.head_dim} must be even (RoPE rotates pairs)")
        if isinstance(self.mtp_depth, bool) or not (isinstance(self.mtp_depth, int) and self.mtp_depth >= 0):
            raise ValueError(f"TransformerConfig.mtp_depth must be an integer >= 0 (0: no multi-token "
                             f"prediction), got {self.mtp_depth!r}")
        if isinstance(self.mtp_loss_weight, bool) or not (isinstance(self.mtp_loss_weight, (int, float))
                                                          and self.mtp_loss_weight >= 0):
            raise ValueError(f"TransformerConfig.mtp_loss_weight must be a number >= 0, got {self.mtp_loss_weight!r}")
        if not (isinstance(self.first_k_dense, int) and self.first_k_dense >= 0):
            raise ValueError(f"TransformerConfig.first_k_dense must be an integer >= 0, got {self.first_k_dense!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"TransformerConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"TransformerConfig.norm_eps must be > 0, got {self.norm_eps}")
        if self.moe is not None and self.moe.hidden != self.hidden:
            raise ValueError(f"TransformerConfig.moe.hidden = {self.moe.hidden} differs from hidden = {self.hidden}")
        if self.mla is not None and (self.qkv_bias or self.qk_norm):
            raise ValueError(f"TransformerConfig.mla has no q/k/v biases or per-head q/k norms (got "
                             f"qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm}; valid: False, False)")
        dense = [i for i in range(self.layers + self.mtp_depth) if not self.is_moe_layer(i)]
        if dense and not (isinstance(self.ffn, int) and self.ffn >= 1):
            raise ValueError(f"TransformerConfig.ffn = {self.ffn!r} but layers {dense} are dense and need "
                             f"a positive ffn")

    def is_moe_layer(self, i: int) -> bool:
        return (self.moe is not None and i >= self.first_k_dense
                and (i - self.first_k_dense) % self.moe_every == 0)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.layers) if self.is_moe_layer(i)]


class Block(nn.Module):
    """One pre-norm decoder layer: ``forward(x [B, S, H], positions, rope) -> [B, S, H]``."""

    def __init__(self, cfg: TransformerConfig, layer: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype)
        if cfg.mla is not None:
            self.attn = MLA(cfg.hidden, cfg.heads, cfg.mla, cfg.rope_theta, dtype)
        else:
            self.attn = Attention(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rope_theta,
                                  cfg.qkv_bias, cfg.qk_norm, cfg.norm_eps, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype)
        self.mlp = MoELayer(cfg.moe, dtype=dtype) if cfg.is_moe_layer(layer) else MLP(cfg.hidden, cfg.ffn, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, rope=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, rope)
        return x + self.mlp(self.mlp_norm(x))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy in fp32 or wider, number of targets != -100) of logits [..., V]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def run_blocks(blocks, x: torch.Tensor, positions: torch.Tensor | None, cfg: TransformerConfig) -> torch.Tensor:
    """``x`` [B, S, H] through ``blocks`` in order (RoPE tables computed once, shared by all)."""
    B, S, _ = x.shape
    pos = torch.arange(S, device=x.device) if positions is None else positions
    if pos.shape[-1] != S or pos.dim() not in (1, 2) or (pos.dim() == 2 and pos.shape[0] != B):
        raise ValueError(f"positions has shape {tuple(pos.shape)}; valid: [{S}] or [{B}, {S}] "
                         f"for tokens [{B}, {S}]")
    if cfg.mla is not None:
        rope = mla_rope_cos_sin(pos, cfg.mla, cfg.rope_theta, x.dtype)
    else:
        rope = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
    for block in blocks:
        x = block(x, positions, rope)
    return x


def run_layers(m: nn.Module, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The model's computation on a run of its layers, from ``m``'s attributes: ``embed``
    (tokens [B, S] -> [B, S, H]; None: x is hidden already), ``layers``, and ``norm`` + ``head``
    (None: return hidden [B, S, H]; a None ``head`` with a norm ties it to ``embed``)."""
    if m.embed is not None:
        x = m.embed(x)  # [B, S, H]
    blocks = m.layers.values() if isinstance(m.layers, nn.ModuleDict) else m.layers
    x = run_blocks(blocks, x, positions, m.cfg)  # [B, S, H]
    if m.norm is None:
        return x
    w_head = m.embed.weight if m.head is None else m.head.weight  # [V, H]
    return F.linear(m.norm(x), w_head)  # [B, S, V]


class MoETransformer(nn.Module):
    """``forward(tokens [B, S] int64, positions [S] | [B, S] | None) -> logits [B, S, V]``.

    ``positions`` are absolute token positions (default ``0..S-1``); pass them when this call
    sees only part of each sequence (context parallelism). ``head`` is a bias-free H -> V
    linear, or None with ``tie_embeddings`` (the embedding matrix is reused).

    Construction never holds more than the weights it is asked for: the modules are built on the
    meta device and then, unless ``device`` is ``"meta"``, materialized there with
    :func:`meshfold.models.init.materialize`, whose values depend only on ``seed`` (default:
    drawn from the global generator, so ``torch.manual_seed`` fixes the model) and each tensor's
    name. Built on meta and handed to ``parallelize`` or ``Pipeline``, each rank materializes
    only its own shards, and the global weights are these same ones (``init_seed`` and
    ``inits`` record what is needed).
    """

    def __init__(self, cfg: TransformerConfig, dtype: torch.dtype | None = None, device=None,
                 seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        device = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):
            self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dtype)  # weight [V, H]
            init.normal_(self.embed.weight, std=0.02)
            self.layers = nn.ModuleList(Block(cfg, i, dtype) for i in range(cfg.layers))
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype)
            if cfg.tie_embeddings:
                self.head = None
            else:
                self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dtype)  # weight [V, H]
                init.normal_(self.head.weight, std=cfg.hidden ** -0.5)
            # multi-token prediction: depth k's block is built as layer layers + k - 1 would be
            self.mtp = nn.ModuleList(
                MTPDepth(cfg.hidden, cfg.norm_eps, Block(cfg, cfg.layers + k - 1, dtype), dtype)
                for k in range(1, cfg.mtp_depth + 1)) if cfg.mtp_depth else None
        self.init_seed = init.draw_seed() if seed is None else seed
        self.inits = init.declared_inits(self)
        if device.type != "meta":
            init.materialize(self, self.inits, self.init_seed, device)

    # Set by parallelize (single device: None): how local logits become the global DTensor, and
    # how a per-rank (sum of cross-entropy, token count) becomes the global mean loss.
    gather_logits = None
    reduce_loss = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V]; on a folded mesh a DTensor on the attention mesh whose
        ``.full_tensor()`` is the global batch's logits."""
        logits = self._logits(tokens, positions)
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def local_logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V] of the tokens this call sees (on a folded mesh: this rank's)."""
        return self._logits(tokens, positions)

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return run_layers(self, tokens, positions)  # [B, S, V]

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """The objective: the mean cross-entropy over targets != -100 (fp32 or wider), plus with
        ``cfg.mtp_depth`` the multi-token-prediction term (:meth:`loss_parts`); on a folded mesh
        the global batch's, the same value on every rank. MoE balancing losses, if configured, are
        already attached to the graph by each MoELayer (see ``last_losses``)."""
        return self.loss_parts(tokens, targets, positions)["loss"]

    def loss_parts(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
                   weights: list[float] | None = None) -> dict[str, torch.Tensor]:
        """``{"loss": the objective (with its graph), "main": the main head's mean cross-entropy}``
        and with ``cfg.mtp_depth = D``, ``"mtp"``: the mean over depths of each depth's mean
        cross-entropy, and ``"mtp_depths"`` [D] each of them (detached); ``loss = main +
        mtp_loss_weight * mtp`` (:func:`~meshfold.models.mtp.mtp_objective`).

        ``targets``: [B, S] next tokens, or with D > 0 the [B, S, 1 + D] of
        :func:`~meshfold.models.mtp.mtp_targets`, which a fold needs (a rank cannot shift its
        slice of the sequence by itself: the tokens ahead sit on other ranks).

        ``weights`` ``[w_0, w_1 .. w_D]`` (None: all 1) scale each mean before it enters the
        objective and the parts (``w_0 * main``, ``w_k * L_k``): gradient accumulation weights a
        micro-batch's term k by its share of the whole batch's term-k positions
        (:func:`~meshfold.parallel.pipeline.accumulate`), so that the micro-batches add up to the
        whole batch's means even where masked targets leave their shares unequal."""
        D = self.cfg.mtp_depth
        if targets.dim() == 2 and D:
            if self.reduce_loss is not None:
                raise ValueError(f"mtp_depth = {D} on a fold: targets {tuple(targets.shape)} are this rank's "
                                 f"slice and cannot be shifted here; pass mtp_targets(global targets, {D}) "
                                 f"[B, S, {1 + D}], sharded like the tokens")
            targets = mtp_targets(targets, D)
        if targets.dim() == 3 and targets.shape[-1] != 1 + D:
            raise ValueError(f"targets have shape {tuple(targets.shape)}; valid with mtp_depth = {D}: "
                             f"[B, S] or [B, S, {1 + D}] (mtp_targets)")
        h = self.norm(self._hidden(tokens, positions))  # [B, S, H]: what the head and depth 1 read
        w = [1.0] * (1 + D) if weights is None else weights
        if len(w) != 1 + D:
            raise ValueError(f"weights {w!r} have {len(w)} entries; valid with mtp_depth = {D}: {1 + D} "
                             f"(the main head's, then each depth's)")
        main_targets = targets if targets.dim() == 2 else targets[..., 0]  # [B, S]
        main = self._weighted_mean(w[0], *self.loss_terms(self._head(h), main_targets))
        if not D:
            return {"loss": main, "main": main.detach()}
        depth = []
        for k, m in enumerate(self.mtp, start=1):
            read, want = depth_inputs(targets, k)  # [B, S] each
            h = m(h, self.embed(read), positions)  # [B, S, H]
            depth.append(self._weighted_mean(w[k], *cross_entropy_sum(self._head(h), want)))
        mtp = torch.stack(depth).detach()
        return {"loss": mtp_objective(main, depth, self.cfg.mtp_loss_weight), "main": main.detach(),
                "mtp": mtp.mean(), "mtp_depths": mtp}

    def _hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The last block's output [B, S, H], before the final norm."""
        return run_blocks(self.layers, self.embed(tokens), positions, self.cfg)

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, V] of normed hidden states [B, S, H] (the head, or the tied embedding)."""
        w_head = self.embed.weight if self.head is None else self.head.weight  # [V, H]
        return F.linear(normed, w_head)

    def _mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return total / count if self.reduce_loss is None else self.reduce_loss(total, count)

    def _weighted_mean(self, weight: float, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        # weight 0: a micro-batch with none of the term's positions, whose own mean (0 / 0) would
        # turn the sum of the micro-batches into NaN; every rank has the same weights, so all skip
        # reduce_loss's collective alike
        return weight * self._mean(total, count) if weight else 0.0 * total

    def loss_terms(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cross-entropy summed over targets != -100, their count)`` of logits [B, S, V]: what
        ``loss`` reduces, and what a pipeline's last stage computes per microbatch."""
        return cross_entropy_sum(logits, targets)

    def moe_layers(self) -> list[MoELayer]:
        """Every MoE layer, the multi-token-prediction blocks' included (as ``Pipeline.moe_layers``)."""
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def moe_blocks(self) -> list[tuple[int, Block]]:
        """``(layer id, block)`` of the main layers' blocks with an MoE layer (as
        ``Pipeline.moe_blocks``; multi-token-prediction blocks are not among them)."""
        return [(i, b) for i, b in enumerate(self.layers) if isinstance(b.mlp, MoELayer)]
