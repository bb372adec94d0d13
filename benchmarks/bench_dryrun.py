"""Wall time and peak memory of ``meshfold dryrun`` on this machine.

Each case runs the command as a subprocess under ``/usr/bin/time -f %M`` (peak resident set of the
command and the worker process it spawns per dry-run rank). Baseline, measured in the same run: a
process that only starts Python and imports torch and meshfold's dry-run engine, which every
dry-run rank pays once. Prints a table and writes JSON.

    python benchmarks/bench_dryrun.py [--out benchmarks/results/dryrun.json] [--cases 128 1024]
        [--before DIR] [--reports DIR]

``--before DIR``: also run every case on the meshfold package in DIR (e.g. ``git archive`` of an
earlier commit), just before the same case on this one, so the CPU-time ratio is measured in
the same run. ``--reports DIR``: keep each case's ``--json`` report there (``before-N.json``,
``after-N.json``) to diff the two: they must be equal but for the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {  # ranks -> (model, fold CP/TP/EP/PP/ETP); pp = 1: one dry-run rank per case
    128: ("mixtral-8x22b", "1/2/8/1/1"),
    1024: ("mixtral-8x22b", "1/8/8/1/1"),  # dp = 128: the paper's global batch of 256 still divides
}


def _timed(argv: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds, peak RSS MiB, stdout) of ``argv``: on a shared machine the CPU
    time is the steadier figure (the wall time includes waiting for other tenants' work)."""
    t0 = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%M %U %S", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd)
    wall = time.perf_counter() - t0
    if done.returncode not in (0, 1):  # 1: a rank out of memory, still a finished dry run
        raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rss_kib, user, system = done.stderr.strip().splitlines()[-1].split()
    return wall, float(user) + float(system), int(rss_kib) / 1024, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/dryrun.json")
    parser.add_argument("--cases", type=int, nargs="+", default=list(CASES))
    parser.add_argument("--before", metavar="DIR", help="an earlier meshfold to run each case on first")
    parser.add_argument("--reports", metavar="DIR", help="keep each case's --json report here")
    args = parser.parse_args()
    py = sys.executable
    base_wall, base_cpu, base_rss, _ = _timed([py, "-c", "import torch, meshfold.dryrun.engine"])
    rows = [{"case": "baseline: start + import", "wall_s": base_wall, "cpu_s": base_cpu, "rss_mib": base_rss}]
    # python -m puts the working directory first on sys.path: the earlier version runs from its own
    versions = [("before", {**os.environ, "PYTHONPATH": args.before}, args.before)] if args.before else []
    versions.append(("after" if args.before else "", None, None))
    for ranks in args.cases:
        model, fold = CASES[ranks]
        for version, env, cwd in versions:
            with tempfile.TemporaryDirectory() as tmp:
                name = f"{version or 'report'}-{ranks}.json"
                path = (Path(args.reports or tmp) / name).resolve()
                wall, cpu, rss, out = _timed([py, "-m", "meshfold", "dryrun", "--model", model, "--gpus", str(ranks),
                                              "--fold", fold, "--json", str(path)], env, cwd)
                report = json.loads(path.read_text())
            r0 = report["ranks"][0]
            rows.append({"case": f"{model} {ranks} ranks {fold} {version}".rstrip(), "wall_s": wall, "cpu_s": cpu,
                         "rss_mib": rss, "peak_gib": r0["peak_bytes"] / 2 ** 30, "collectives": len(r0["collectives"]),
                         **{k: r0[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                               "activation_peak_bytes")},
                         "dry_run_s": report["wall_s"]})
    print(f"{'case':<49} {'wall s':>8} {'CPU s':>7} {'CPU x base':>10} {'RSS MiB':>9} {'rank peak GiB':>14}")
    for r in rows:
        print(f"{r['case']:<49} {r['wall_s']:8.1f} {r['cpu_s']:7.1f} {r['cpu_s'] / base_cpu:10.1f} "
              f"{r['rss_mib']:9.0f} {r.get('peak_gib', float('nan')):14.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    sys.exit(main())
