"""What counting live tensor bytes (``meshfold.runtime.live_bytes.LiveBytes``, the CPU's
``memory.tensor_mib``) costs a ``meshfold train`` step.

One run of the default ``meshfold train`` job (the embedded config, 4 gloo ranks, with
``train.tensor_memory=true``) in which the count is on for odd steps and off for even ones, so
both halves see the same load over time; the figure is the ratio of the median ``step_s`` (rank
0's metrics) of the counted steps to that of the others, step 1 (warm-up, one-off allocations)
left out. Then, in this process and on one thread, the default model's forward and backward
(no fold, batch 2 x 128) with no mode, with a dispatch mode that only calls each op, and with
LiveBytes, interleaved over rounds: what any Python dispatch mode costs per op, and what the
counting adds. Prints two tables, writes JSON.

    python benchmarks/bench_tensor_peak.py --steps 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank, world_size, run):
    from meshfold.train import tracking
    from meshfold.train.loop import train_rank

    counted = tracking.StepMemory.step
    steps = iter(range(1, 1 << 30))

    @contextmanager
    def every_other(self):
        if next(steps) % 2:
            with counted(self):
                yield
        else:
            yield  # this step's tensor_mib repeats the last counted step's

    tracking.StepMemory.step = every_other
    return train_rank(rank, world_size, run)


def _one_process(rounds: int) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshfold.models.transformer import MoETransformer
    from meshfold.runtime.live_bytes import LiveBytes
    from meshfold.train.config import load_config

    class CallOnly(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CallOnly.ops += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    _, mcfg = load_config(None, []).validate()
    torch.manual_seed(0)
    model = MoETransformer(mcfg)
    tokens, targets = torch.randint(0, mcfg.vocab, (2, 2, 128)).unbind(0)

    def step():
        model.loss(tokens, targets).backward()
        model.zero_grad(set_to_none=True)

    modes = {"no mode": contextlib.nullcontext(), "call-only mode": CallOnly(), "LiveBytes": LiveBytes()}
    with modes["call-only mode"]:
        step()
    ops, times = CallOnly.ops, {k: [] for k in modes}
    for _ in range(rounds):
        for name, mode in modes.items():
            t0 = time.perf_counter()
            with mode:
                step()
            times[name].append(time.perf_counter() - t0)
    return {"ops_per_step": ops, "median_s": {k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default="benchmarks/results/tensor_peak.json")
    args = ap.parse_args(argv)

    from meshfold.runtime.launch import spawn
    from meshfold.train.config import load_config
    from meshfold.train.rundir import RunLock, prepare

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cfg = load_config(None, [f"train.steps={args.steps}", f"train.eval_every={args.steps}",
                                 f"train.ckpt_every={args.steps}", "train.tensor_memory=true",
                                 f"train.out_dir={json.dumps(str(out))}"])
        run = cfg.resolve()
        with RunLock(out) as lock:
            prepare(lock, run.cfg, run.model)
        spawn(_rank, run.spec.world_size, run, timeout=cfg.train.timeout)
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    on = [r["step_s"] for r in rows if r["step"] > 1 and r["step"] % 2]
    off = [r["step_s"] for r in rows if r["step"] > 1 and not r["step"] % 2]
    result = {"steps": args.steps, "world_size": spec.world_size, "median_step_s_counted": statistics.median(on),
              "median_step_s_not_counted": statistics.median(off),
              "ratio": statistics.median(on) / statistics.median(off),
              "tensor_peak_mib_rank0": max(r["memory"]["tensor_mib"][0] for r in rows if r["step"] % 2),
              "load_average": os.getloadavg()}
    print("| steps | ranks | counted median step s | not counted | ratio |\n|---|---|---|---|---|")
    print(f"| {args.steps} | {spec.world_size} | {result['median_step_s_counted']:.4f} | "
          f"{result['median_step_s_not_counted']:.4f} | {result['ratio']:.3f} |")
    result["one_process"] = one = _one_process(args.rounds)
    base = one["median_s"]["no mode"]
    print(f"\none process, one thread, {one['ops_per_step']} ops per forward + backward, {args.rounds} rounds")
    print("| mode | median ms | ratio |\n|---|---|---|")
    for name, t in one["median_s"].items():
        print(f"| {name} | {1e3 * t:.1f} | {t / base:.3f} |")
    result["load_average_end"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    sys.exit(main())
