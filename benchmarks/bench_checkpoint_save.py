"""What checkpoint checksums cost: a checkpoint save with and without them, and the hashes.

A save with checksums hashes every file it wrote (BLAKE2b, :func:`meshfold.train.checkpoint.checksum`);
the baseline is the same save with that step replaced by nothing, measured alternately in the same
run (median of ``--repeats``); with the ``xxhash`` package installed, also the save hashing with
XXH3 instead. Then the candidate hashes over the largest shard's bytes, for the
choice of hash. Prints a table and writes JSON::

    python benchmarks/bench_checkpoint_save.py --model tiny-moe --repeats 7 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import platform
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from unittest import mock

import torch

try:
    import xxhash
except ImportError:  # optional: only compared when installed
    xxhash = None

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
    variants = {"with checksums": contextlib.nullcontext,
                "without": lambda: mock.patch.object(checkpoint, "_checksums", lambda folder, rank: {})}
    if xxhash is not None:  # the same save hashing with XXH3 instead (an optional package)
        variants["with xxh3 instead"] = lambda: mock.patch.object(checkpoint, "checksum", _xxh3_file)
    times = {label: [] for label in variants}
    cpu = {label: [] for label in variants}  # this process's CPU seconds: less shaken by other load
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.repeats):
            for label, patch in variants.items():  # alternated: a load change on the machine hits all alike
                with patch():
                    t0, c0 = time.perf_counter(), time.process_time()
                    final = checkpoint.save(root, i + 1, model, opt, {"step": i + 1})
                    times[label].append(time.perf_counter() - t0)
                    cpu[label].append(time.process_time() - c0)
        shard = max(final.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        data = shard.read_bytes()
        mb = sum(p.stat().st_size for p in final.iterdir()) / 1e6
    hashes = {"blake2b (16 bytes)": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
              "sha256": lambda b: hashlib.sha256(b).digest(), "crc32 (zlib)": zlib.crc32}
    if xxhash is not None:
        hashes["xxh3_128 (xxhash)"] = lambda b: xxhash.xxh3_128(b).digest()
    speed = {}
    for name, fn in hashes.items():
        best = min(_timed(fn, data) for _ in range(3))
        speed[name] = len(data) / best / 1e6
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    slower = {k: v / med["without"] - 1 for k, v in med.items() if k != "without"}
    slower_cpu = {k: v / med_cpu["without"] - 1 for k, v in med_cpu.items() if k != "without"}
    print(f"CPU: {_cpu()}; model {args.model}, checkpoint {mb:.1f} MB")
    print(f"{'save':<20}{'median s':>10}{'CPU s':>8}{'slower':>8}{'CPU':>8}")
    for k, v in med.items():
        more = f"{slower[k] * 100:>+7.1f}%{slower_cpu[k] * 100:>+7.1f}%" if k in slower else ""
        print(f"{k:<20}{v:>10.3f}{med_cpu[k]:>8.3f}{more}")
    print(f"{'hash':<20}{'MB/s':>8}")
    for k, v in speed.items():
        print(f"{k:<20}{v:>8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": _cpu(), "model": args.model, "MB": mb, "save_s": times,
                                               "median_s": med, "slower": slower,
                                               "cpu_s": cpu, "median_cpu_s": med_cpu, "slower_cpu": slower_cpu, "hash_MB_s": speed}, indent=1))


def _xxh3_file(file) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, xxhash.xxh3_128).hexdigest()


def _timed(fn, data) -> float:
    t0 = time.perf_counter()
    fn(data)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
