"""PNG plots of a run from its metrics.jsonl: loss curves, and the expert load (a heatmap of each
expert's share, and each ep rank's rows over the mean with the worst MoE layer's max / mean;
re-placement steps are marked, labelled with where the first MoE layer's hot-expert copies went).

matplotlib is an optional extra (``pip install meshfold[plots]``); without it the plots are
skipped with a note, never an error.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["replacement_marks", "write_plots"]


def replacement_marks(rows: list[dict]) -> list[tuple[int, str]]:
    """``(step, label)`` of each re-placement in ``rows`` (metrics.jsonl rows): ``re-placed``, and
    with copies where the first MoE layer's are, e.g. ``copies e0: r1 r2 r3; e5: r0``."""
    from meshfold.train.expert_load import copy_ranks

    out = []
    for r in rows:
        placed = r.get("expert_placement")
        if not placed or not r.get("ep_rank_rows"):
            continue
        copies = (placed.get("copies") or [[]])[0]
        where = copy_ranks(copies, len(r["ep_rank_rows"][0]))
        label = "copies " + "; ".join(f"e{e}: " + " ".join(f"r{k}" for k in ks) for e, ks in where.items()) \
            if where else "re-placed"
        out.append((r["step"], label))
    return out


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
    rows = [r for line in open(out / "metrics.jsonl") if line.strip() and "loss" in (r := json.loads(line))]  # not gaps
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
        steps = [r["step"] for r in load]
        ranked = [r for r in load if "ep_rank_rows" in r]
        fig, axes = plt.subplots(2 if ranked else 1, 1, figsize=(7, 7 if ranked else 4), squeeze=False)
        ax = axes[0, 0]
        im = ax.imshow(m.T, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(steps[0], steps[-1], m.shape[1] - 0.5, -0.5))
        ax.set_xlabel("step")
        ax.set_yticks(range(m.shape[1]))
        ax.set_ylabel("expert (first MoE layer)")
        ax.set_title("expert load: share of routed tokens")
        fig.colorbar(im, ax=ax)
        if ranked:  # what every ep rank waits for: the busiest rank's rows over the mean
            ax = axes[1, 0]
            x = [r["step"] for r in ranked]
            rows_SR = np.array([r["ep_rank_rows"][0] for r in ranked], dtype=float)
            mean_S = rows_SR.mean(1, keepdims=True).clip(min=1e-9)
            for rank in range(rows_SR.shape[1]):
                ax.plot(x, rows_SR[:, rank] / mean_S[:, 0], lw=1, label=f"ep rank {rank}")
            ax.plot(x, [max(r["ep_max_over_mean"]) for r in ranked], "k--", lw=1.5,
                    label="max/mean, worst MoE layer")
            ax.axhline(1.0, color="grey", lw=0.5)
            for step, label in replacement_marks(load):  # rows after it are split over the copies
                ax.axvline(step, color="grey", ls=":", lw=1)
                ax.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                            ha="right", fontsize="x-small")
            ax.set_xlabel("step")
            ax.set_ylabel("rows / mean rows per ep rank")
            ax.set_title("ep rank load (first MoE layer)")
            ax.legend(fontsize="small", ncol=2)
        fig.tight_layout()
        fig.savefig(out / "expert_load.png", dpi=110)
        plt.close(fig)
        paths.append(out / "expert_load.png")
    return paths
