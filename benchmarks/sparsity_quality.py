"""Does a tile-wise pruned MoE keep its quality? Guo et al.'s claim (SC 2020), in miniature.

    python benchmarks/sparsity_quality.py tokenize          # BPE-tokenize the corpus (once)
    python benchmarks/sparsity_quality.py run dense         # one run at a time (each a few minutes)
    python benchmarks/sparsity_quality.py run tw            # ... tile, unstructured
    python benchmarks/sparsity_quality.py report            # table, loss curves (PNG), JSON

Text: the Python standard library's sources (``meshfold train``'s default corpus, 2.5M tokens),
tokenized by ``meshfold tokenize --train-tokenizer 4096`` (a byte-level BPE trained on the same
files), the last 5% held out for validation. Model: a Mixtral-style MoE small enough for a shared
2-core CPU (hidden 64, 2 layers, 8 experts of ffn 128, top-2, vocab 4096), ``meshfold train`` on
one rank, batch 8 x 128 tokens, 600 steps (the same 614k-token budget for every run, a quarter of
an epoch), AdamW at 3e-3 with a cosine decay.

Runs differ only in ``[sparsity]``: the experts are pruned to 75% with the gradual schedule
25% -> 50% -> 75% at steps 150, 250, 350 (then 250 steps of fine-tuning), magnitude scores and
one global threshold over all MoE layers, in one of three patterns:

* ``tw``: the paper's tile-wise pattern, stripes of G = 32 columns each dropping whole single
  rows (tile 1 x 16, so the rows are exact, as in the paper);
* ``tile``: 16 x 16 blocks (block sparsity, the paper's BW);
* ``unstructured``: single weights (tile 1 x 1), magnitude pruning, the paper's baseline (EW).

``dense`` is the same model without pruning. Reported: the final validation loss (mean over
``train.eval_batches`` held-out batches at the last step) and the validation curves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "runs" / "sparsity_quality"  # tokens and run folders (not committed)
RESULTS = ROOT / "benchmarks" / "results"
VOCAB = 4096
STEPS, BATCH, SEQ = 600, 8, 128
PRUNE_STEPS = (150, 250, 350)  # to 25, 50, 75% expert sparsity
MODEL = ["model.vocab=4096", "model.hidden=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
         "model.ffn=128", "moe.ffn=128", "moe.num_experts=8", "moe.topk=2"]
TRAIN = ["fold.world_size=1", "fold.tp=1", "fold.ep=1", f"train.steps={STEPS}", f"train.batch={BATCH}",
         f"train.seq={SEQ}", "train.lr=3e-3", "train.warmup=50", "train.eval_every=50", "train.eval_batches=8",
         "train.ckpt_every=100000"]
SCHEDULE = ["sparsity.schedule=[0.25, 0.5, 0.75]", f"sparsity.start_step={PRUNE_STEPS[0]}",
            f"sparsity.steps_per_stage={PRUNE_STEPS[1] - PRUNE_STEPS[0]}", 'sparsity.score="magnitude"']
RUNS = {
    "dense": [],
    "tw": ['sparsity.pattern="tw"', "sparsity.tile=[1, 16]", "sparsity.stripe=32", *SCHEDULE],
    "tile": ['sparsity.pattern="tile"', "sparsity.tile=[16, 16]", *SCHEDULE],
    "unstructured": ['sparsity.pattern="tile"', "sparsity.tile=[1, 1]", *SCHEDULE],
}


def tokenize() -> None:
    from meshfold.data.files import default_corpus_paths
    from meshfold.data.tokens import tokenize as run

    index = run([str(p) for p in default_corpus_paths()], WORK / "tokens", train_vocab=VOCAB)
    print(f"{index['tokens']:,} tokens, vocab {index['vocab_size']}")


def train(name: str) -> None:
    sets = MODEL + TRAIN + RUNS[name] + ["train.resume=false"]
    cmd = [sys.executable, "-m", "meshfold", "train", "--data", str(WORK / "tokens"), "--out-dir", str(WORK / name),
           *[a for s in sets for a in ("--set", s)]]
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in open(WORK / name / "metrics.jsonl") if line.strip()]


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: rows(name) for name in RUNS if (WORK / name / "metrics.jsonl").exists()}
    final = {name: r[-1]["val_loss"] for name, r in runs.items()}
    summary = {"steps": STEPS, "tokens_per_run": STEPS * BATCH * SEQ, "final_val_loss": final,
               "final_expert_sparsity": {n: r[-1].get("expert_sparsity", 0.0) for n, r in runs.items()},
               "settings": {"model": MODEL, "train": TRAIN, "runs": RUNS}}
    if {"dense", "tw", "unstructured"} <= set(final):
        summary["tw_minus_dense"] = final["tw"] - final["dense"]
        summary["tw_minus_unstructured"] = final["tw"] - final["unstructured"]
    (RESULTS / "sparsity_quality.json").write_text(json.dumps(summary, indent=1))
    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        val = [x for x in r if "val_loss" in x]
        ax_val.plot([x["step"] for x in val], [x["val_loss"] for x in val], label=f"{name} ({final[name]:.3f})")
        window = 25  # a running mean of the noisy per-batch training loss
        losses = [x["loss"] for x in r]
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax_train.plot([x["step"] for x in r], smooth, label=name, lw=1)
    for ax, what in ((ax_val, "validation loss"), (ax_train, f"training loss (mean of {window} steps)")):
        for at in PRUNE_STEPS:
            ax.axvline(at, color="0.8", lw=0.8)
        ax.set_xlabel("step (pruned to 25 / 50 / 75% at the grey lines)")
        ax.set_ylabel(f"{what}, nats / token")
        ax.legend()
    ax_val.set_ylim(top=min(max(final.values()) + 1.0, ax_val.get_ylim()[1]))
    ax_train.set_ylim(top=min(max(final.values()) + 1.5, ax_train.get_ylim()[1]))
    fig.suptitle("MoE experts pruned to 75%: tile-wise (TW), 16x16 tiles, unstructured vs dense")
    fig.tight_layout()
    fig.savefig(RESULTS / "sparsity_quality.png", dpi=110)
    print("| run | final validation loss | vs dense |")
    print("|---|---|---|")
    for name, loss in final.items():
        print(f"| {name} | {loss:.4f} | {loss - final.get('dense', loss):+.4f} |")
    print(json.dumps({k: v for k, v in summary.items() if k.startswith("tw_")}, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["tokenize", "run", "report"])
    parser.add_argument("name", nargs="?", choices=list(RUNS))
    args = parser.parse_args(argv)
    if args.what == "tokenize":
        tokenize()
    elif args.what == "run":
        if args.name is None:
            parser.error(f"run needs a name: {', '.join(RUNS)}")
        train(args.name)
    else:
        report()


if __name__ == "__main__":
    main()
