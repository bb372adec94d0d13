"""PNG plots of a run from its metrics.jsonl: loss curves and the expert-load heatmap.

matplotlib is an optional extra (``pip install meshfold[plots]``); without it the plots are
skipped with a note, never an error.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_plots"]


def write_plots(out_dir: str | Path) -> list[Path] | str:
    """Write ``loss.png`` and ``expert_load.png`` into ``out_dir``; returns the paths, or a note
    saying why nothing was drawn."""
    out = Path(out_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'meshfold[plots]'); plots skipped"
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    if not rows:
        return "no metrics recorded; plots skipped"
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("meshfold train: loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    paths.append(out / "loss.png")
    load = [r for r in rows if "tokens_per_expert" in r]
    if load:
        import numpy as np

        # [steps, experts] of the first MoE layer, each row as a fraction of that step's tokens
        m = np.array([r["tokens_per_expert"][0] for r in load], dtype=float)
        m = m / m.sum(1, keepdims=True).clip(min=1)
        fig, ax = plt.subplots(figsize=(7, 4))
        im = ax.imshow(m.T, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(load[0]["step"], load[-1]["step"], m.shape[1] - 0.5, -0.5))
        ax.set_xlabel("step")
        ax.set_yticks(range(m.shape[1]))
        ax.set_ylabel("expert (first MoE layer)")
        ax.set_title("expert load: share of routed tokens")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / "expert_load.png", dpi=110)
        plt.close(fig)
        paths.append(out / "expert_load.png")
    return paths
