"""What checkpoint checksums cost: a checkpoint save with and without them, and the hashes.

A save with checksums hashes every file it wrote (:func:`meshfold.train.checkpoint.checksum`, by
each hash of :data:`~meshfold.train.checkpoint.CHECKSUMS`: XXH3-128, what a save writes, and
BLAKE2b, what checkpoints recorded before); the baseline is the same save with that step replaced
by nothing. The variants are measured alternately in the same run (a load change on the machine
hits all alike); the table gives each one's median of ``--repeats`` and its spread (min-max) in
wall and CPU seconds, the change of the medians against the baseline, and the CPU-time ratio of
each save to the baseline save of the same repeat (median, quartiles, min-max). Then the candidate
hashes over the largest shard's bytes, for the choice of hash. Prints a table and writes JSON::

    python benchmarks/bench_checkpoint_save.py --model tiny-moe --repeats 7 --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from unittest import mock

import torch
import xxhash

from meshfold.models.transformer import MoETransformer
from meshfold.train import checkpoint
from meshfold.train.config import TrainConfig


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    cfg = TrainConfig(model={"name": args.model})
    model = MoETransformer(cfg.model_config())
    opt = torch.optim.AdamW(model.parameters())
    variants = {"without": lambda: mock.patch.object(checkpoint, "_checksums", lambda folder, rank: {})}
    for name in checkpoint.CHECKSUMS:  # the same save hashing with each
        variants[name] = lambda name=name: mock.patch.object(checkpoint, "CHECKSUM", name)
    times = {label: [] for label in variants}
    cpu = {label: [] for label in variants}  # this process's CPU seconds: less shaken by other load
    with tempfile.TemporaryDirectory() as root:
        final = checkpoint.save(root, 0, model, opt, {"step": 0})  # untimed: the first save's one-time costs
        step = 0
        for i in range(args.repeats):
            labels = list(variants)[i % len(variants):] + list(variants)[:i % len(variants)]
            for label in labels:  # alternated, in turn first: a load change on the machine hits all alike
                patch = variants[label]
                if final is not None:  # one checkpoint on disk at a time, removed before the clock starts
                    shutil.rmtree(final)
                step += 1  # a new folder each time: no save replaces an older one while timed
                with patch():
                    t0, c0 = time.perf_counter(), time.process_time()
                    final = checkpoint.save(root, step, model, opt, {"step": step})
                    times[label].append(time.perf_counter() - t0)
                    cpu[label].append(time.process_time() - c0)
        shard = max(final.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        data = shard.read_bytes()
        mb = sum(p.stat().st_size for p in final.iterdir()) / 1e6
    hashes = {"blake2b (16 bytes)": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
              "sha256": lambda b: hashlib.sha256(b).digest(), "crc32 (zlib)": zlib.crc32,
              "xxh3_128 (xxhash)": lambda b: xxhash.xxh3_128(b).digest()}
    speed = {}
    for name, fn in hashes.items():
        best = min(_timed(fn, data) for _ in range(3))
        speed[name] = len(data) / best / 1e6
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    slower = {k: v / med["without"] - 1 for k, v in med.items() if k != "without"}
    slower_cpu = {k: v / med_cpu["without"] - 1 for k, v in med_cpu.items() if k != "without"}
    print(f"CPU: {_cpu()}; model {args.model}, checkpoint {mb:.1f} MB, {args.repeats} repeats; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'save':<14}{'median s':>10}{'min-max':>16}{'CPU s':>8}{'min-max':>16}{'slower':>8}{'CPU':>8}")
    for k, v in med.items():
        more = f"{slower[k] * 100:>+7.1f}%{slower_cpu[k] * 100:>+7.1f}%" if k in slower else ""
        print(f"{k:<14}{v:>10.3f}{_spread(times[k]):>16}{med_cpu[k]:>8.3f}{_spread(cpu[k]):>16}{more}")
    # each repeat's saves ran back to back: their CPU-time ratio to that repeat's baseline is less
    # shaken by load that changes over the run than a ratio of medians
    paired = {k: sorted(c / b - 1 for c, b in zip(v, cpu["without"])) for k, v in cpu.items() if k != "without"}
    print(f"{'save':<14}{'CPU vs without, same repeat: median':>38}{'quartiles':>20}{'min-max':>20}")
    for k, v in paired.items():
        q1, _, q3 = statistics.quantiles(v, n=4) if len(v) > 1 else (v[0],) * 3
        print(f"{k:<14}{statistics.median(v) * 100:>+37.1f}%{q1 * 100:>+9.1f}%..{q3 * 100:>+7.1f}%"
              f"{v[0] * 100:>+9.1f}%..{v[-1] * 100:>+7.1f}%")
    print(f"{'hash':<20}{'MB/s':>8}")
    for k, v in speed.items():
        print(f"{k:<20}{v:>8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": _cpu(), "model": args.model, "MB": mb, "save_s": times,
                                               "median_s": med, "slower": slower, "cpu_s": cpu,
                                               "median_cpu_s": med_cpu, "slower_cpu": slower_cpu,
                                               "cpu_vs_without_same_repeat": paired,
                                               "hash_MB_s": speed, "loadavg": os.getloadavg()}, indent=1))


def _spread(xs) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}"


def _timed(fn, data) -> float:
    t0 = time.perf_counter()
    fn(data)
    return time.perf_counter() - t0


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
