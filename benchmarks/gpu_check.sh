#!/usr/bin/env bash
# The prepared check for a lent GPU (one device, under 6 minutes): kernel numerics, the grouped-GEMM
# benchmark, and a 1-rank NCCL training step, each writing JSON into $OUT (or benchmarks/results/).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root
#
# 1. tests/kernels/test_kernels*.py on CUDA: the Triton forward and both backward kernels (dX, dW) against
#    the plain torch reference in fp32, bf16 and fp16, dense and tile-masked, with empty experts
#    and a partial tail (the tests skipped "needs CUDA" on CPU machines), and a meta-built model on a
#    1-rank NCCL group holding and communicating only CUDA tensors (tests/parallel/test_devices.py);
# 2. benchmarks/bench_grouped_gemm.py --device cuda: Triton vs F.grouped_mm vs per-expert cuBLAS vs
#    one dense cuBLAS GEMM of equal FLOPs, measured in the same run;
# 3. torchrun --nproc-per-node 1 -m meshfold train: tiny-moe in bf16 on NCCL for 30 steps, MFU
#    against the h200 preset (meshfold plan's), and the metrics of its last step;
# 4. benchmarks/bench_overlap.py under a 1-rank NCCL group (bf16, about 20 s): the shared expert
#    overlapped with the dispatch vs the same layer waiting for it, checked bitwise equal. One rank
#    has no real all-to-all (its "all-to-all" is a local copy on the NCCL stream), so this measures
#    what the asynchronous path costs (or saves by running that copy beside the shared expert's
#    GEMMs), not the multi-GPU gain, which needs ep > 1.
# Each part's exit status is recorded; the script exits non-zero if any failed, after all ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
GPU="${MESHFOLD_GPU_PRESET:-h200}"
status=0

echo "== 1/4 kernel numerics (CUDA) =="
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_kernels_interpret.py \
    tests/parallel/test_devices.py::test_under_nccl_everything_is_on_the_gpu \
    --junitxml "$OUT/gpu_kernels.xml" 2>&1 | tee "$OUT/gpu_kernels.log" | tail -15
k=${PIPESTATUS[0]}; [ "$k" = 0 ] || status=1

echo "== 2/4 grouped GEMM benchmark (CUDA) =="
timeout 150 "$PY" benchmarks/bench_grouped_gemm.py --device cuda --out "$OUT/grouped_gemm_cuda.json" 2>&1 | tail -40
b=${PIPESTATUS[0]}; [ "$b" = 0 ] || status=1

echo "== 3/4 one-GPU training (NCCL, bf16 compute, MFU vs $GPU) =="
RUN="$(mktemp -d)/run"
timeout 120 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29533 \
    -m meshfold train --steps 30 --out-dir "$RUN" --set fold.world_size=1 --set fold.tp=1 --set fold.ep=1 \
    --set model.name=tiny-moe --set train.dtype=bfloat16 --set train.gpu="$GPU" --set train.batch=8 \
    --set train.seq=1024 --set model.max_seq=1024 --set train.eval_every=1000 --set train.ckpt_every=30 2>&1 | tail -8
t=${PIPESTATUS[0]}; [ "$t" = 0 ] || status=1

echo "== 4/4 shared expert overlapped with the dispatch (1-rank NCCL, bf16) =="
timeout 60 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29534 \
    benchmarks/bench_overlap.py --tokens 8192 --hidden 2048 --ffn 1408 --shared-ffn 5632 --experts 8 \
    --dtype bfloat16 --reps 20 --out "$OUT/overlap_cuda.json" 2>&1 | tail -4
o=${PIPESTATUS[0]}; [ "$o" = 0 ] || status=1

"$PY" - "$OUT" "$RUN" "$k" "$b" "$t" "$o" <<'PYEOF'
import json, sys
from pathlib import Path
out, run, k, b, t, o = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:])
import torch
summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "torch": torch.__version__, "exit": {"kernels": k, "grouped_gemm": b, "train": t, "overlap": o}}
metrics = run / "metrics.jsonl"
if metrics.exists():
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    last = rows[-1]
    summary["train"] = {"steps": len(rows), "first_loss": rows[0]["loss"], "last_loss": last["loss"],
                        "tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"],
                        "mfu_of_measured_gemm": last["mfu_of_measured_gemm"]}
overlap = Path(out) / "overlap_cuda.json"
if overlap.exists():
    summary["overlap"] = json.loads(overlap.read_text())
gemm = Path(out) / "grouped_gemm_cuda.json"
if gemm.exists():
    summary["grouped_gemm"] = str(gemm)
Path(out, "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PYEOF
exit $status
