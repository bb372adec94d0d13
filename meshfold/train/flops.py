"""FLOPs per training step, counted as Megatron-Core counts them (Megatron-LM's
``num_floating_point_operations``, megatron/training/training.py; arXiv 2504.14960's MFU).

Per layer, forward, for B sequences of s tokens, hidden h, n heads, g KV heads, head dim c:

* attention: ``2*B*s*h * (n*c + 2*g*c)`` (q, k, v) ``+ 2*B*s*n*c*h`` (out) ``+ 4*B*s^2*n*c``
  (scores and weighted sum over the full s x s square: the older, un-halved count, as the
  reference formula writes ``s/h`` not ``s/(2h)``);
* SwiGLU MLP of width f: ``6*B*s*h*f`` (gate, up, down); an MoE layer counts ``k`` experts of
  width f_e plus the shared expert;
* head: ``2*B*s*h*V``;
* each multi-token-prediction depth (``mtp_depth``): one more layer of its kind (layer id
  ``layers + k - 1``), its ``2h -> h`` projection ``4*B*s*h^2`` and one more head.

Training is 3x forward (backward = 2x). Router and norms are ignored, as in Megatron-Core.
"""

from __future__ import annotations

__all__ = ["train_flops_per_step"]


def train_flops_per_step(cfg, batch: int, seq: int) -> float:
    B, s, h = batch, seq, cfg.hidden
    n, g, c = cfg.heads, cfg.kv_heads, cfg.head_dim
    total = 0.0
    depth = getattr(cfg, "mtp_depth", 0)
    for i in range(cfg.layers + depth):
        attn = 2 * B * s * h * (n * c + 2 * g * c) + 2 * B * s * n * c * h + 4 * B * s * s * n * c
        if cfg.is_moe_layer(i):
            m = cfg.moe
            mlp = 6 * B * s * h * (m.ffn * m.topk + m.shared_ffn)
        else:
            mlp = 6 * B * s * h * cfg.ffn
        total += attn + mlp
    total += (1 + depth) * 2 * B * s * h * cfg.vocab + depth * 4 * B * s * h * h
    return 3.0 * total
