#!/usr/bin/env bash
# The prepared check for a lent GPU: one device, at most 300 s by the sum of its parts' timeouts
# (the device's whole budget is 15 minutes, start-up included). From the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh      # default OUT: benchmarks/results/gpu_check
#
# Every part writes its status into OUT/gpu_check.json as it ends (a skeleton listing every part
# as "not run" is written first), and its log into OUT; the script exits non-zero if any failed.
#  1. preflight: python / torch / triton / numpy / CUDA / NCCL versions and the GPU; without
#     CUDA it fails at once (the JSON says why) and nothing else runs;
#  2. 1-rank NCCL: all_gather_v, reduce_scatter_v on the native fp32 path, the ring shift, ring
#     attention on a cp = 1 mesh against SDPA in bf16 (forward and backward, the SDPA backend named);
#  3. the Triton kernels on CUDA against the reference (fp32 / bf16 / fp16, dense and masked) and
#     a meta-built model on a 1-rank NCCL group holding only CUDA tensors; autotuning times at most
#     MESHFOLD_TRITON_MAX_CONFIGS configs per launch; pytest runs under SIGINT's timeout, so it
#     still writes its summary;
#  4. the grouped-GEMM benchmark (bf16, fwd and fwd+bwd): every method's numbers checked against
#     the fp32 reference at every shape before timing, Triton vs F.grouped_mm vs per-expert cuBLAS
#     vs one dense GEMM of equal FLOPs;
#  5. training: tiny-moe in bf16 over fp32 master weights on 1-rank NCCL, 16 steps, a checkpoint
#     at step 8 (DCP and every RNG, CUDA's included), MFU against the h200 preset;
#  6. resume: a second run from that step-8 checkpoint to step 16, whose losses must be the first's;
#  7. memory: the CUDA peak of 3 steps of a small config against meshfold dryrun's prediction.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MESHFOLD_TRITON_MAX_CONFIGS="${MESHFOLD_TRITON_MAX_CONFIGS:-2}"
PY="${PYTHON:-python3}"
DRIVER=benchmarks/gpu_check.py
# part -> seconds; pytest gets SIGINT at its limit and SIGKILL KILL_AFTER later
declare -A LIMIT=([preflight]=30 [nccl]=30 [kernels]=55 [grouped_gemm]=40 [train]=70 [resume_run]=40
                  [resume]=5 [memory]=25)
KILL_AFTER=5
total=$KILL_AFTER
for part in "${!LIMIT[@]}"; do total=$((total + LIMIT[$part])); done
[ "$total" -le 300 ] || { echo "gpu_check.sh: timeouts sum to $total s > 300 s" >&2; exit 2; }
status=0

# run PART CMD...: CMD under its part's timeout, log in OUT/PART.log, exit status into the JSON
run() {
    local part=$1; shift
    echo "== $part (limit ${LIMIT[$part]} s) =="
    timeout "${LIMIT[$part]}" "$@" > "$OUT/$part.log" 2>&1
    local rc=$?
    tail -20 "$OUT/$part.log"
    "$PY" "$DRIVER" "$OUT" record "$part" "$rc" "$OUT/$part.log" || true
    [ "$rc" = 0 ] || status=1
    return "$rc"
}

echo "== preflight =="
timeout "${LIMIT[preflight]}" "$PY" "$DRIVER" "$OUT" preflight > "$OUT/preflight.log" 2>&1
rc=$?
cat "$OUT/preflight.log"
if [ "$rc" != 0 ]; then
    [ -f "$OUT/gpu_check.json" ] || echo '{"parts": {"preflight": {"status": "failed"}}}' > "$OUT/gpu_check.json"
    "$PY" "$DRIVER" "$OUT" record preflight "$rc" "$OUT/preflight.log" 2>/dev/null
    echo "gpu_check.sh: preflight failed (exit $rc); see $OUT/gpu_check.json" >&2
    exit 1
fi

run nccl "$PY" "$DRIVER" "$OUT" nccl

echo "== kernels (limit ${LIMIT[kernels]} s, then SIGINT) =="
timeout -s INT -k "$KILL_AFTER" "${LIMIT[kernels]}" "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/kernels/test_kernels_interpret.py -k "cuda or nccl" tests/parallel/test_devices.py::test_under_nccl_everything_is_on_the_gpu \
    --junitxml "$OUT/kernels.xml" > "$OUT/kernels.log" 2>&1
rc=$?
tail -15 "$OUT/kernels.log"
# a skip here means CUDA went missing after the preflight: a failure, not a pass
if [ "$rc" = 0 ] && grep -q " skipped" "$OUT/kernels.log"; then rc=3; fi
"$PY" "$DRIVER" "$OUT" record kernels "$rc" "$OUT/kernels.log"
[ "$rc" = 0 ] || status=1

run grouped_gemm "$PY" benchmarks/bench_grouped_gemm.py --device cuda --dtypes bfloat16 \
    --out "$OUT/grouped_gemm_cuda.json"

RUN_A="$OUT/train_run"
RUN_B="$OUT/resume_run"
rm -rf "$RUN_A" "$RUN_B"
TRAIN=(-m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29533 -m meshfold train
       --steps 16 --set fold.world_size=1 --set fold.tp=1 --set fold.ep=1 --set model.name=tiny-moe
       --set train.dtype=bfloat16 --set train.master_dtype=float32 --set train.gpu=h200 --set train.batch=8
       --set train.seq=1024 --set model.max_seq=1024 --set train.eval_every=1000 --set train.ckpt_every=8)
run train "$PY" "${TRAIN[@]}" --out-dir "$RUN_A"
first=$(ls -d "$RUN_A"/checkpoints/step_* 2>/dev/null | sort | head -1)
if [ -n "$first" ]; then
    mkdir -p "$RUN_B/checkpoints" && cp -r "$first" "$RUN_B/checkpoints/"
    run resume_run "$PY" "${TRAIN[@]}" --out-dir "$RUN_B"
    run resume "$PY" "$DRIVER" "$OUT" resume "$RUN_A" "$RUN_B"
else
    echo "no checkpoint in $RUN_A: resume not run" | tee "$OUT/resume.log"
    "$PY" "$DRIVER" "$OUT" record resume 1 "$OUT/resume.log"
    status=1
fi

run memory "$PY" "$DRIVER" "$OUT" memory

cat "$OUT/gpu_check.json"
exit $status
