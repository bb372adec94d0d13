"""A training step's time by phase, from ``meshfold train``'s own profile (rank 0's Chrome trace).

    meshfold train ... --set train.profile_steps=[5,5]          # writes <out_dir>/profile/rank0-steps5-5.json
    python benchmarks/step_phases.py A/profile/rank0-steps5-5.json B/profile/rank0-steps5-5.json

Every op on the training thread is charged its self time (its duration less that of the ops it
encloses), and the phase is read from the op and the ranges around it, innermost first:
meshfold's autograd functions (dispatch permutes, the top-k combine, the experts' SwiGLU, the
token all-to-alls) and torch's (``evaluate_function: <Node>`` in backward) name the phase of the ops
inside them; a GEMM inside the experts' grouped GEMM is the experts', any other a dense one
(attention projections, router, dense MLP, head). "collectives" includes the time a rank waits in
them for its peers: with more ranks than cores, that is mostly the time a peer computes on the
core this rank shares. "Python between ops" is the step's time no op covers.
Prints a markdown table (one column per trace) and writes benchmarks/results/step_phases.json.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (phase, substrings of a name), tried in order: first against the enclosing ranges (innermost
# first) for the phases up to and including the attention core, which a range names whole, then
# against the op's own name and its ranges for all of them
PHASES = [
    ("optimizer", ("Optimizer.step", "Optimizer.zero_grad")),
    ("collectives (waits included)", ("c10d::", "gloo:", "record_param_comms", "_A2A", "_AllToAllV", "_AllGatherV",
                                      "_ReduceScatterV", "_GlobalMean", "all_gather", "reduce_scatter", "all_reduce",
                                      "FSDP::all_gather", "wait_tensor")),
    ("experts: grouped GEMMs", ("grouped_mm",)),
    ("experts: SwiGLU", ("_SwiGLU",)),
    ("MoE combine", ("_CombineTopK",)),
    ("MoE dispatch: permutes", ("_PermuteRows", "_GatherRows", "IndexCopy", "index_select", "index_copy")),
    ("attention core (SDPA)", ("scaled_dot_product", "flash_attention", "ScaledDotProduct")),
    ("router (top-k, softmax)", ("topk", "Topk", "softmax", "Softmax", "aten::sort")),
    ("norms (rsqrt, pow, mean)", ("rsqrt", "Rsqrt", "aten::pow", "PowBackward", "aten::mean", "MeanBackward")),
    ("dense GEMMs (attention, router, MLP, head)", ("aten::mm", "aten::addmm", "aten::bmm", "MmBackward")),
    ("host syncs (.item)", ("aten::item", "_local_scalar_dense")),
    ("casts and copies", ("aten::_to_copy", "aten::copy_", "aten::to")),
    ("FSDP2 hooks (other)", ("FSDP",)),
]
OTHER_ATEN = "other ops (elementwise, cross-entropy, RoPE, DTensor)"
PYTHON = "Python between ops"


def _ops(path: str):
    """(event, self time in us, names of the enclosing ranges, innermost first) of the training
    thread (the one with the ``step N`` range), and the step ranges."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    main = next(e["tid"] for e in events if e["name"].startswith("step "))
    events = sorted((e for e in events if e["tid"] == main), key=lambda e: (e["ts"], -e["dur"]))
    out, stack = [], []
    for e in events:
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
            out.append(stack.pop())
        if stack:
            stack[-1][1] -= e["dur"]
        stack.append([e, e["dur"], [s[0]["name"] for s in reversed(stack)]])
    out.extend(stack)
    return out


RANGE_PHASES = PHASES[:7]  # up to the attention core


def _phase(name: str, parents: list[str]) -> str:
    for names, phases in ((parents, RANGE_PHASES), ([name, *parents], PHASES)):
        for n in names:
            for phase, keys in phases:
                if any(k in n for k in keys):
                    return phase
    return OTHER_ATEN


def phases(path: str) -> dict:
    """{phase: seconds} of the profiled steps in ``path``, and ``step`` (their total)."""
    ops = _ops(path)
    total = sum(e["dur"] for e, _, _ in ops if e["name"].startswith("step "))
    out = collections.Counter()
    for e, own, parents in ops:
        if not e["name"].startswith("step "):
            out[_phase(e["name"], [p for p in parents if not p.startswith("step ")])] += own
    out[PYTHON] = total - sum(out.values())
    return {k: v / 1e6 for k, v in out.items()} | {"step": total / 1e6}


def main(paths: list[str]) -> None:
    res = {p: phases(p) for p in paths}
    keys = sorted({k for r in res.values() for k in r if k != "step"}, key=lambda k: -max(r.get(k, 0) for r in res.values()))
    print("| phase | " + " | ".join(paths) + " |\n|---|" + "---:|" * len(paths))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{r.get(k, 0) * 1e3:.0f} ms ({100 * r.get(k, 0) / r['step']:.0f}%)"
                                       for r in res.values()) + " |")
    print("| **step** | " + " | ".join(f"{r['step'] * 1e3:.0f} ms" for r in res.values()) + " |")
    out = ROOT / "benchmarks" / "results" / "step_phases.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
