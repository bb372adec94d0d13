"""Activation recomputation none / selective / full: bytes a forward keeps for backward, and step time.

    python benchmarks/bench_recompute.py                      # seq 512 and 2048, about 2 minutes
    python benchmarks/bench_recompute.py --seqs 1024 --rounds 5

Model: fp32, vocab 256, hidden 256, 4 layers, all MoE, 8 heads / 4 KV heads with qk-norm, 8 experts
of ffn 512 top-2 and a shared expert of ffn 512, dropless, one process (one device, no fold).
Batch 2 sequences.

``kept`` = storage bytes of the tensors created during the forward that are still alive when it
returns (``meshfold.testing.references.LiveTensors``, weights excluded): what the forward keeps for backward,
plus the loss; the logits [B, S, V] saved for the cross-entropy are kept in every mode, so
``blocks`` = kept - logits is what the transformer blocks keep (with the final norm's
and the head's inputs, about 3 MiB at seq 512). ``step`` = forward + backward,
median over rounds, the three modes in rotating order within each round (the same load for all).

Writes benchmarks/results/recompute.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshfold.models import MoEConfig  # noqa: E402
from meshfold.parallel.recompute import RECOMPUTE, apply_recompute  # noqa: E402
from meshfold.models.transformer import MoETransformer, TransformerConfig  # noqa: E402
from meshfold.testing.references import LiveTensors  # noqa: E402

MIB = 2 ** 20


def model_config() -> TransformerConfig:
    moe = MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, shared_ffn=512, shared_kind="qwen2")
    return TransformerConfig(vocab=256, hidden=256, layers=4, heads=8, kv_heads=4, qk_norm=True, moe=moe)


def build(mode: str) -> MoETransformer:
    model = MoETransformer(model_config(), dtype=torch.float32, seed=0)
    apply_recompute(model.layers, mode)
    return model


def kept_bytes(model, tokens) -> tuple[int, int]:
    """(bytes kept by the forward, bytes of the logits among them)."""
    with LiveTensors(exclude=[*model.parameters(), *model.buffers()]) as live:
        loss = model.loss(tokens, tokens)
        kept = live.bytes()
    loss.backward()
    B, S = tokens.shape
    return kept, B * S * model.cfg.vocab * 4


def step_time(model, tokens) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    model.loss(tokens, tokens).backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="512,2048")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for S in (int(s) for s in args.seqs.split(",")):
        tokens = torch.randint(0, 256, (args.batch, S), generator=torch.Generator().manual_seed(0))
        models = {m: build(m) for m in RECOMPUTE}
        memory = {m: kept_bytes(models[m], tokens) for m in RECOMPUTE}
        for m in RECOMPUTE:  # warm-up
            step_time(models[m], tokens)
        times = {m: [] for m in RECOMPUTE}
        for r in range(args.rounds):
            for i in range(len(RECOMPUTE)):
                m = RECOMPUTE[(r + i) % len(RECOMPUTE)]
                times[m].append(step_time(models[m], tokens))
        base_blocks = memory["none"][0] - memory["none"][1]
        base_time = statistics.median(times["none"])
        for m in RECOMPUTE:
            kept, logits = memory[m]
            t = statistics.median(times[m])
            rows.append({"seq": S, "batch": args.batch, "recompute": m, "kept_bytes": kept, "logits_bytes": logits,
                         "blocks_bytes": kept - logits, "blocks_vs_none": (kept - logits) / base_blocks,
                         "step_s": t, "time_vs_none": t / base_time, "steps_s": times[m]})
    out = {"machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
           "torch": torch.__version__, "threads": 1, "rows": rows}
    path = ROOT / "benchmarks" / "results" / "recompute.json"
    path.write_text(json.dumps(out, indent=1))
    print("| seq | recompute | kept (MiB) | logits (MiB) | blocks (MiB) | blocks vs none | step (s) | time vs none |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seq']} | {r['recompute']} | {r['kept_bytes'] / MIB:.1f} | {r['logits_bytes'] / MIB:.1f} | "
              f"{r['blocks_bytes'] / MIB:.1f} | {r['blocks_vs_none']:.2f} | {r['step_s']:.3f} | "
              f"{r['time_vs_none']:.2f} |")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
