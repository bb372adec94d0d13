"""Per-rank memory and step time against sequence length, context parallelism and recomputation.

    python benchmarks/bench_long_context.py                          # S 2k 8k 16k, cp 1 2 4, every recompute mode
    python benchmarks/bench_long_context.py --seqs 32768 --cps 4 --recompute full
    PYTHONPATH=/path/to/old/checkout python benchmarks/bench_long_context.py --label before

One training step (forward, backward) of a small MoE transformer on ``cp`` gloo ranks (fold
``cp`` x ``ep = cp``, FSDP2, fp32, one sequence of S tokens), for each S, cp and
``recompute`` mode the code under test offers (a checkout without ``parallelize(recompute=)``
runs ``none`` only, so the same script measures the code before and after). Per rank, worst rank
reported:

* ``tracked peak MiB``: the largest sum of bytes of the tensors the step allocated and still held
  at once (a dispatch mode that follows every new storage until it is freed): activations saved
  for backward, the working set of attention, the gathered parameters, the gradients. It is
  exact and independent of the allocator, so ratios between runs are meaningful at any load.
* ``largest tensor``: the biggest single allocation, in elements (a [S/cp, S] mask or score
  tensor shows up here).
* ``rss MiB``: the resident set the step added at its peak (``peak_rss``), for comparison.
* ``step s``: wall time of the second step (the first one warms caches), on a machine shared
  with other tenants: compare within one run only.

Model: vocab 256, hidden 256, 2 layers, 8 query heads over 2 key/value heads (GQA) of dim 32,
qk-norm, 8 experts of ffn 256, top-2, dropless. Writes ``benchmarks/results/long_context_<label>.json``
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import platform
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MODES = ("none", "selective", "full")


class StoragePeak:
    """A dispatch mode tracking the bytes of every storage created under it until it is freed."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._record(out)
                return out

        self.mode = _Mode()
        self.live = {}  # storage key -> bytes
        self.now = self.peak = 0
        self.largest = 0

    def _record(self, out):
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            local = getattr(t, "_local_tensor", t)
            if local.device.type == "meta":
                continue
            st = local.untyped_storage()
            key = st.data_ptr()
            if key in self.live or st.nbytes() == 0:
                continue
            self.live[key] = st.nbytes()
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            self.largest = max(self.largest, local.numel())
            weakref.finalize(st, self._free, key)

    def _free(self, key):
        self.now -= self.live.pop(key, 0)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _config():
    from meshfold.models import MoEConfig
    from meshfold.models.transformer import TransformerConfig

    return TransformerConfig(vocab=256, hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, qk_norm=True,
                             moe=MoEConfig(hidden=256, ffn=256, num_experts=8, topk=2))


def _rank(rank, world_size, S, recompute):
    import torch

    from meshfold.mesh import FoldSpec, fold
    from meshfold.models.transformer import MoETransformer
    from meshfold.models.transformer_parallel import parallelize, shard_batch
    from peak_rss import peak_rss_mib

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD: freed blocks leave the RSS
    torch.set_num_threads(1)
    spec = FoldSpec(world_size, cp=world_size, ep=world_size)
    folded = fold(spec, "cpu")
    cfg = _config()
    kwargs = {"recompute": recompute} if recompute != "none" else {}
    model = parallelize(MoETransformer(cfg, device="meta", seed=0), folded, **kwargs)
    tokens = torch.randint(0, cfg.vocab, (1, S), generator=torch.Generator().manual_seed(0))
    local, pos = shard_batch(tokens, spec, rank)

    def step():
        model.loss(local, local, pos).backward()

    def timed():
        t0 = time.perf_counter()
        step()
        box["seconds"] = time.perf_counter() - t0

    box = {}
    step()  # warm-up; gradients stay allocated, as in a training step after the first
    rss = peak_rss_mib(timed)
    with StoragePeak() as tracked:
        step()
    return {"tracked_mib": tracked.peak / 2 ** 20, "largest": tracked.largest, "rss_mib": rss,
            "step_s": box["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", nargs="+", type=int, default=[2048, 8192, 16384])
    ap.add_argument("--cps", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--recompute", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--label", default="after")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from meshfold.launch import spawn
    from meshfold.models.transformer_parallel import parallelize

    offered = MODES if "recompute" in inspect.signature(parallelize).parameters else ("none",)
    modes = [m for m in args.recompute if m in offered]
    rows = []
    for S in args.seqs:
        for cp in args.cps:
            for mode in modes:
                ranks = spawn(_rank, cp, S, mode, timeout=1800)
                worst = max(ranks, key=lambda r: r["tracked_mib"])
                row = {"S": S, "cp": cp, "recompute": mode, **worst,
                       "step_s": max(r["step_s"] for r in ranks)}
                rows.append(row)
                print(row, flush=True)
    out = {"label": args.label, "cpu": platform.processor() or platform.machine(),
           "load": os.getloadavg(), "rows": rows}
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    Path(__file__).with_name("results").joinpath(f"long_context_{args.label}.json").write_text(json.dumps(out, indent=1))
    base = {(r["S"], r["cp"]): r for r in rows if r["recompute"] == "none"}
    print(f"\n{args.label} (load {os.getloadavg()[0]:.1f}):")
    print("| S | cp | recompute | tracked peak MiB (x cp=1 none) | largest tensor | rss MiB | step s (x none) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ref = base.get((r["S"], 1))
        same = base.get((r["S"], r["cp"]))
        mem = f"{r['tracked_mib']:.0f}" + (f" ({r['tracked_mib'] / ref['tracked_mib']:.2f}x)" if ref else "")
        t = f"{r['step_s']:.2f}" + (f" ({r['step_s'] / same['step_s']:.2f}x)" if same else "")
        print(f"| {r['S']} | {r['cp']} | {r['recompute']} | {mem} | {r['largest']:,} | {r['rss_mib']:.0f} | {t} |")


if __name__ == "__main__":
    main()
