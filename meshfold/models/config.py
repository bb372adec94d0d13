"""``MoEConfig``: every knob of one MoE layer, validated before anything runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MoEConfig"]

_SCORES = ("softmax", "sigmoid")
_DROP_POLICIES = ("probs", "position")
_DROP_SCOPES = ("sub_sequence", "full_sequence")
_EXPERT_KINDS = ("swiglu", "gelu")
_SHARED_KINDS = (None, "qwen2", "deepseek")


@dataclass
class MoEConfig:
    """One MoE layer (names follow Megatron-Core's ``--moe-*`` flags where one exists).

    Sizes: ``hidden`` (H), ``ffn`` (F, per expert), ``num_experts`` (E), ``topk`` (k).

    Router: ``score_function`` softmax | sigmoid; ``pre_softmax`` (softmax over all E, then top-k;
    otherwise top-k on logits, then softmax over k); ``renormalize`` the top-k weights to sum to 1
    (HF Mixtral, Qwen2-MoE ``norm_topk_prob``; Megatron does this for sigmoid with k > 1);
    ``topk_scaling_factor``; group-limited routing ``num_groups`` / ``group_topk``, a group scoring
    the sum of its best ``group_score_topk`` experts (None: ``topk // group_topk``, Megatron-Core;
    Hugging Face DeepSeek-V3 always sums the best 2); ``input_jitter``
    (multiplicative uniform noise in training); ``router_dtype`` float32 | float64; aux-loss-free
    ``expert_bias`` with ``expert_bias_rate``.

    Losses (coefficients; 0 disables): ``aux_loss_coeff`` (Switch, per DP rank's micro-batch),
    ``seq_aux_loss_coeff`` (per sequence), ``global_aux_loss_coeff`` (Switch over the tokens of all
    DP ranks), ``z_loss_coeff``.

    Dropping: ``capacity_factor`` None = dropless; ``drop_policy`` probs | position;
    ``drop_scope`` sub_sequence (each rank decides on its own tokens, the paper's default) |
    full_sequence (decide over the tokens of one DP rank, gathered over attn tp x cp);
    ``pad_to_capacity``.

    Experts: ``expert_kind`` swiglu | gelu; ``shared_ffn`` (0 = none) with ``shared_kind``
    qwen2 (gated by sigmoid of a linear) | deepseek (ungated); ``expert_sparsity`` (a
    ``meshfold.train.sparsity`` config, tile-sparse expert weights).
    """

    hidden: int
    ffn: int
    num_experts: int
    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = True
    renormalize: bool = True
    topk_scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    group_score_topk: int | None = None
    input_jitter: float = 0.0
    router_dtype: torch.dtype = torch.float32
    expert_bias: bool = False
    expert_bias_rate: float = 1e-3
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    global_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    drop_scope: str = "sub_sequence"
    pad_to_capacity: bool = False
    expert_kind: str = "swiglu"
    shared_ffn: int = 0
    shared_kind: str | None = None
    expert_sparsity: Any = None

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "num_experts", "topk"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"MoEConfig.{name} must be a positive integer, got {v!r}")
        E, k = self.num_experts, self.topk
        if k > E:
            raise ValueError(f"MoEConfig.topk = {k} exceeds num_experts = {E} (valid: 1..{E})")
        self._choice("score_function", _SCORES)
        self._choice("drop_policy", _DROP_POLICIES)
        self._choice("drop_scope", _DROP_SCOPES)
        self._choice("expert_kind", _EXPERT_KINDS)
        self._choice("shared_kind", _SHARED_KINDS)
        if self.router_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"MoEConfig.router_dtype must be torch.float32 or torch.float64, "
                             f"got {self.router_dtype}")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError(f"group-limited routing needs both num_groups and group_topk, got "
                             f"num_groups={self.num_groups}, group_topk={self.group_topk}")
        if self.num_groups is not None:
            G, g = self.num_groups, self.group_topk
            if not (isinstance(G, int) and G >= 1 and E % G == 0):
                raise ValueError(f"num_groups = {G} must divide num_experts = {E}")
            if not (isinstance(g, int) and 1 <= g <= G):
                raise ValueError(f"group_topk = {g} must be in 1..num_groups = {G}")
            n = self.group_score_topk
            if n is not None and not (isinstance(n, int) and 1 <= n <= E // G):
                raise ValueError(f"group_score_topk = {n} must be in 1..{E // G} (the experts per group)")
            if n is None and k % g:
                raise ValueError(f"topk = {k} must be divisible by group_topk = {g} (each chosen "
                                 f"group contributes topk / group_topk scores to its group score)")
            if k > g * (E // G):
                raise ValueError(f"topk = {k} exceeds the {g * (E // G)} experts in "
                                 f"group_topk = {g} groups of {E // G}")
        if self.capacity_factor is not None and not self.capacity_factor >= 0:
            raise ValueError(f"capacity_factor must be >= 0 or None (dropless), got "
                             f"{self.capacity_factor} (0 drops every token: a test of the "
                             f"shared-expert-only path)")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("pad_to_capacity needs a capacity_factor (dropless has no capacity)")
        if self.shared_ffn < 0:
            raise ValueError(f"shared_ffn must be >= 0, got {self.shared_ffn}")
        if self.shared_ffn and self.shared_kind is None:
            self.shared_kind = "qwen2"
        if not 0 <= self.input_jitter < 1:
            raise ValueError(f"input_jitter must be in [0, 1), got {self.input_jitter}")

    def _choice(self, name: str, valid: tuple) -> None:
        if getattr(self, name) not in valid:
            raise ValueError(f"MoEConfig.{name} = {getattr(self, name)!r}; valid: {list(valid)}")

    @property
    def any_aux_loss(self) -> bool:
        return bool(self.aux_loss_coeff or self.seq_aux_loss_coeff or self.global_aux_loss_coeff)
