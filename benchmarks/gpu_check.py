"""The parts of benchmarks/gpu_check.sh that run in Python, and its JSON summary.

    python benchmarks/gpu_check.py OUT preflight            # versions, the GPU; fails without CUDA
    python benchmarks/gpu_check.py OUT nccl                 # 1-rank NCCL: all_gather_v, reduce_scatter_v,
                                                            # ring shift, ring attention (cp = 1) vs SDPA
    python benchmarks/gpu_check.py OUT resume RUN_A RUN_B   # the resumed run continues the first one's losses
    python benchmarks/gpu_check.py OUT memory               # CUDA peak of a small config vs meshfold dryrun
    python benchmarks/gpu_check.py OUT record PART RC LOG   # a part's exit status, from the shell

Every part updates ``OUT/gpu_check.json`` (read, change one entry, write back), so the file says
what ran, what passed and why something failed whatever happens later; a part's own errors are
caught and written there with their traceback's last line, and its exit status is non-zero.
Runs on the lent machine's Python 3.12 / torch 2.11 / triton 3.6 as on newer ones.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("preflight", "nccl", "kernels", "grouped_gemm", "train", "resume_run", "resume", "memory")


def summary_path(out: Path) -> Path:
    return out / "gpu_check.json"


def update(out: Path, part: str, **fields) -> dict:
    """Merge ``fields`` into the summary's entry for ``part`` and write the file at once."""
    path = summary_path(out)
    summary = json.loads(path.read_text()) if path.exists() else skeleton()
    summary["parts"].setdefault(part, {}).update(fields)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(path)
    return summary


def skeleton() -> dict:
    return {"parts": {p: {"status": "not run"} for p in PARTS}}


def run_part(out: Path, part: str, fn, *args) -> int:
    """``fn(*args)`` -> dict of results; its status, time and results (or error) go to the summary."""
    update(out, part, status="running")
    t0 = time.perf_counter()
    try:
        result = fn(*args) or {}
    except Exception as err:  # noqa: BLE001 - every failure is written to the summary
        update(out, part, status="failed", seconds=round(time.perf_counter() - t0, 1),
               error=f"{type(err).__name__}: {err}"[:2000], where=traceback.format_exc().splitlines()[-3:])
        traceback.print_exc()
        return 1
    failed = result.pop("failed", [])
    update(out, part, status="failed" if failed else "ok", seconds=round(time.perf_counter() - t0, 1),
           failed_checks=failed, **result)
    return 1 if failed else 0


# ----------------------------------------------------------------------------- preflight


def preflight(out: Path) -> dict:
    import platform
    from importlib import metadata

    import torch

    def version(package):  # read from the installed metadata: importing triton takes seconds
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": version("triton"),
            "numpy": version("numpy"), "cuda_build": torch.version.cuda, "cuda_visible": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), devices=torch.cuda.device_count())
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    print(json.dumps(info, indent=1))
    update(out, "preflight", **info)  # kept when the check below fails
    if not torch.cuda.is_available():
        raise RuntimeError(f"CUDA is not visible (torch {torch.__version__}, built for CUDA "
                           f"{torch.version.cuda}): this check needs a GPU; nothing else was run")
    return info


# ----------------------------------------------------------------------------- 1-rank NCCL


def _init_nccl():
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)


def nccl() -> dict:
    """all_gather_v, reduce_scatter_v on the native fp32 path, the ring shift, and ring attention
    on a cp = 1 mesh against SDPA in bf16, forward and backward, all on a 1-rank NCCL group."""
    import torch
    import torch.distributed as dist

    from meshfold.mesh import FoldSpec, backend_device_type, collective_backend, fold
    from meshfold.parallel import ring_attention as ring
    from meshfold.placements import all_gather_v, reduce_scatter_v
    from meshfold.placements import collectives
    from meshfold.placements.ring import ring_shift

    _init_nccl()
    failed, res = [], {}
    try:
        folded = fold(FoldSpec(1))
        res["device_type"] = folded.device.type
        res["backend_config"] = dist.get_backend_config()
        if backend_device_type() != "cuda" or collective_backend(None, "cuda") != "nccl":
            failed.append(f"backend detection: {backend_device_type()} / {collective_backend(None, 'cuda')}")
        mesh = folded.attn
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(6, 5, device="cuda", generator=g, requires_grad=True)
        y = all_gather_v(x, [6], mesh, "tp")
        y.sum().backward()
        res["all_gather_v"] = bool(torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x)))
        res["native_fp32_reduce_scatter"] = collectives._native_scatter([6], torch.float32, mesh.get_group("tp"),
                                                                        "cuda")
        x.grad = None
        z = reduce_scatter_v(x, [6], mesh, "tp")
        z.sum().backward()
        res["reduce_scatter_v"] = bool(torch.equal(z, x) and torch.equal(x.grad, torch.ones_like(x)))
        t = [torch.arange(7, device="cuda", dtype=torch.float32), torch.ones(2, 3, device="cuda")]
        back = ring_shift(t, mesh, "cp")()
        res["ring_shift"] = all(torch.equal(a, b) for a, b in zip(back, t))
        for name in ("all_gather_v", "native_fp32_reduce_scatter", "reduce_scatter_v", "ring_shift"):
            if not res[name]:
                failed.append(name)
        res["ring_attention"] = _ring_vs_sdpa(folded)
        failed += res["ring_attention"].pop("failed")
    finally:
        dist.destroy_process_group()
    res["failed"] = failed
    return res


def _ring_vs_sdpa(folded) -> dict:
    """Ring attention (cp = 1: the rank's two chunks, one full and two diagonal blocks) against
    SDPA on the whole sequence, bf16, GQA; the SDPA backend that ran is named."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from meshfold.parallel import ring_attention as ring

    B, h, g, S, d = 2, 8, 2, 1024, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, n, S, d, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (h, g, g))
    do = torch.randn(B, h, S, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = {"kernel": ring.block_kernels(q, k, v)}

    def grads(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        return (o, *torch.autograd.grad(o, leaves, do))

    got = grads(lambda a, b, c: ring.ring_attention(a, b, c, folded.stage("attn"), "cp"))
    want = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                want = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True))
            out["sdpa_backend"] = backend.name
            break
        except RuntimeError:
            continue
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(a.double(), b.double(), c.double(), is_causal=True,
                                                               enable_gqa=True))
    failed = []
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, want, ref):
        err_ring = (a.double() - r).abs().max().item()
        err_sdpa = (b.double() - r).abs().max().item()
        out[f"{name}_max_err_vs_fp64"] = {"ring": err_ring, "sdpa": err_sdpa}
        if not err_ring <= 2 * err_sdpa + 1e-2:  # bf16 rounding: within twice SDPA's own error
            failed.append(f"ring attention {name}: max error {err_ring:.3g} vs SDPA's {err_sdpa:.3g}")
    out["failed"] = failed
    return out


# ----------------------------------------------------------------------------- training


def resume(run_a: str, run_b: str) -> dict:
    """Run B resumed run A's mid-run checkpoint (DCP and every RNG, the CUDA one included) and
    trained to the same step: its losses after the checkpoint must be run A's, to bf16 noise."""
    rows_a, rows_b = (_metrics(Path(r)) for r in (run_a, run_b))
    ckpts = sorted((Path(run_a) / "checkpoints").glob("step_*"))
    rng = json.loads((ckpts[0] / "rng_rank0.json").read_text()) if ckpts else {}
    a = {r["step"]: r["loss"] for r in rows_a}
    b = {r["step"]: r["loss"] for r in rows_b}
    common = sorted(set(a) & set(b) - {min(a)})
    diffs = {s: abs(a[s] - b[s]) for s in common}
    failed = []
    if "cuda" not in rng:
        failed.append(f"checkpoint {ckpts[0] if ckpts else '(none)'} holds no CUDA RNG state")
    if not common:
        failed.append(f"no step in both runs: {sorted(a)} / {sorted(b)}")
    elif max(diffs.values()) > 2e-2 * max(abs(a[s]) for s in common):
        failed.append(f"resumed losses differ: {diffs}")
    return {"steps_a": len(rows_a), "resumed_steps": sorted(b), "max_loss_diff": max(diffs.values(), default=None),
            "first_loss": rows_a[0]["loss"] if rows_a else None, "last_loss": rows_a[-1]["loss"] if rows_a else None,
            "tokens_per_s": rows_a[-1].get("tokens_per_s") if rows_a else None,
            "mfu": rows_a[-1].get("mfu") if rows_a else None, "failed": failed}


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# train settings shared by the memory check and its dry run
MEMORY_RUN = {"model.name": "tiny-moe", "train.batch": 4, "train.seq": 512, "model.max_seq": 512}


def memory_dryrun_args(sets: dict, report: Path) -> list[str]:
    """``meshfold dryrun``'s arguments for the job the memory part trains with ``sets``: the same
    settings (``--set``), so the dry run builds that job, on fake CUDA, its report in ``report``."""
    return ["dryrun", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), "--gpu", "h200",
            "--device", "cuda", "--json", str(report)]


def memory(out: Path) -> dict:
    """The CUDA peak of 3 training steps of a small config (in this process, on a 1-rank NCCL
    group) against ``meshfold dryrun``'s peak for the same config (a subprocess: it runs on a
    fake process group)."""
    import subprocess

    import torch
    import torch.distributed as dist

    from meshfold.train.config import load_config
    from meshfold.train.loop import train_rank

    run = out / "memory_run"
    sets = {**MEMORY_RUN, "train.steps": 3, "train.dtype": "bfloat16", "train.out_dir": str(run),
            "train.eval_every": 1000, "train.ckpt_every": 1000, "fold.world_size": 1, "fold.tp": 1, "fold.ep": 1}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    _init_nccl()
    try:
        torch.cuda.reset_peak_memory_stats()
        train_rank(0, 1, cfg.resolve())
        measured = torch.cuda.max_memory_allocated()
    finally:
        dist.destroy_process_group()
    report = out / "memory_dryrun.json"
    cmd = [sys.executable, "-m", "meshfold", *memory_dryrun_args(sets, report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    (out / "memory_dryrun.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"measured_peak_bytes": measured, "failed": [f"dryrun exit {proc.returncode}: {proc.stderr[-500:]}"]}
    predicted = json.loads(report.read_text())["ranks"][0]["peak_bytes"]
    return {"measured_peak_bytes": measured, "dryrun_peak_bytes": predicted, "measured_over_dryrun":
            round(measured / predicted, 3), "config": MEMORY_RUN, "failed": []}


# ----------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    out, part, *rest = argv
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if part == "record":  # a shell-run part: its exit status (124: timed out) and log
        name, rc, log = rest[0], int(rest[1]), rest[2]
        status = "ok" if rc == 0 else "timed out" if rc in (124, 130, 137) else "failed"
        entry = json.loads(summary_path(out).read_text())["parts"].get(name, {}) if summary_path(out).exists() else {}
        tail = Path(log).read_text(errors="replace").splitlines()[-12:] if Path(log).exists() else []
        # a part that wrote its own failure keeps it; the exit status can only make it worse
        if entry.get("status") == "failed":
            status = "failed"
        update(out, name, status=status, exit=rc, log=str(log), log_tail=tail)
        return 0
    if part == "preflight":
        summary_path(out).write_text(json.dumps(skeleton(), indent=1) + "\n")  # the skeleton, first
        return run_part(out, part, preflight, out)
    if part == "nccl":
        return run_part(out, part, nccl)
    if part == "resume":
        return run_part(out, part, resume, *rest)
    if part == "memory":
        return run_part(out, part, memory, out)
    raise SystemExit(f"unknown part {part!r}; valid: preflight, nccl, resume, memory, record")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
