#!/usr/bin/env bash
# One row of meshfold's torch version matrix: in a fresh venv with torch VERSION, the main command
# (`meshfold train`, a few steps) and a fast subset of the tests that touch torch's distributed APIs.
#
#   benchmarks/torch_matrix.sh VERSION [STEPS]
#
# The venv is /work/venvs/torch-VERSION (MATRIX_VENVS sets the parent folder), made anew each run
# (MATRIX_REUSE=1 keeps one that exists, installing only meshfold into it again).
# torch comes from pip's configured indexes; a folder of wheels at $MATRIX_VENVS/wheels-VERSION,
# where present, is searched first (pip downloads CUDA builds of several GB). A release that pip's
# configuration caps away installs with that configuration bypassed for this run only:
#   PIP_CONFIG_FILE=/dev/null benchmarks/torch_matrix.sh 2.15.0
# Writes benchmarks/results/torch_matrix/VERSION.json (its logs: $MATRIX_LOGS, default
# $MATRIX_VENVS/logs) and prints one
# Markdown row for benchmarks/RESULTS.md. Exit status: 0 when the main command and every test pass.
set -uo pipefail

VERSION=${1:?usage: benchmarks/torch_matrix.sh VERSION [STEPS]}
STEPS=${2:-20}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${MATRIX_VENVS:-/work/venvs}
VENV=$VENVS/torch-$VERSION
WHEELS=$VENVS/wheels-$VERSION
OUT=$REPO/benchmarks/results/torch_matrix
LOGS=${MATRIX_LOGS:-$VENVS/logs}
mkdir -p "$OUT" "$LOGS"
LOG=$LOGS/torch-$VERSION
rm -rf "$LOG.install.log" "$LOG.train.log" "$LOG.tests.log"

# The fast subset: mesh, placements, MoE layer, folded transformer, sharded construction, mixed
# precision, resume, the dry run's real-vs-fake steps, and meshfold.runtime.compat's own checks.
TESTS=(tests/mesh/test_mesh.py tests/placements/test_placements.py tests/parallel/test_moe_layer.py tests/parallel/test_transformer_parallel.py
       tests/parallel/test_sharded_construction.py tests/parallel/test_mixed_precision.py tests/runtime/test_compat.py
       "tests/train/test_train.py::test_resume_equals_uninterrupted"
       "tests/dryrun/test_dryrun.py::test_dry_run_reports_the_real_step_on_4_ranks"
       "tests/dryrun/test_dryrun.py::test_dry_run_reports_the_real_step_on_8_ranks"
       "tests/dryrun/test_dryrun.py::test_dry_run_reports_the_real_pipeline_step_of_the_last_stage")

stamp() { date +%s; }
t0=$(stamp)
links=()
[ -d "$WHEELS" ] && links=(--find-links "$WHEELS")
if [ "${MATRIX_REUSE:-0}" = 1 ] && [ -x "$VENV/bin/python" ]; then
  # a venv this script (or the same pip commands) made before: only meshfold is installed again
  echo "torch_matrix $VENV: reused (MATRIX_REUSE=1)"
  venv_kind=reused
  "$VENV/bin/pip" install --no-compile "${links[@]}" "torch==$VERSION" -e "$REPO[test]" >"$LOG.install.log" 2>&1
else
  echo "torch_matrix $VERSION: fresh venv $VENV"
  venv_kind=fresh
  rm -rf "$VENV"
  python3 -m venv "$VENV" || exit 1
  {
    "$VENV/bin/pip" install --no-compile "${links[@]}" "torch==$VERSION" &&
    "$VENV/bin/pip" install --no-compile "${links[@]}" -e "$REPO[test]"
  } >"$LOG.install.log" 2>&1
fi
install_rc=$?
t1=$(stamp)
if [ $install_rc -ne 0 ]; then
  echo "torch_matrix $VERSION: install failed (exit $install_rc), see $LOG.install.log"
  tail -5 "$LOG.install.log"
  exit 1
fi

# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PYTHONPATH=$REPO  # this checkout's meshfold, whatever else the venv holds
cd "$REPO" || exit 1
versions=$(python -c 'import sys, numpy, torch, triton; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")' 2>&1)
echo "torch_matrix $VERSION: $versions"

run_dir=$(mktemp -d)
timeout 1800 meshfold train --out-dir "$run_dir/run" --steps "$STEPS" >"$LOG.train.log" 2>&1
train_rc=$?
t2=$(stamp)
final_loss=$(sed -n 's/^done: final loss \([0-9.]*\).*/\1/p' "$LOG.train.log" | tail -1)
rm -rf "$run_dir"
echo "torch_matrix $VERSION: meshfold train --steps $STEPS exit $train_rc, final loss ${final_loss:-none}, $((t2 - t1)) s"

timeout 5400 python -m pytest "${TESTS[@]}" -q -p no:cacheprovider -o addopts="-ra --strict-markers" >"$LOG.tests.log" 2>&1
tests_rc=$?
t3=$(stamp)
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|in [0-9.]+s' "$LOG.tests.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
echo "torch_matrix $VERSION: tests exit $tests_rc: $summary ($((t3 - t2)) s)"

python - "$OUT/$VERSION.json" <<EOF
import json, sys
json.dump({"torch": "$VERSION", "venv": "$venv_kind", "versions": "$versions", "steps": $STEPS, "install_s": $((t1 - t0)),
           "train_exit": $train_rc, "final_loss": "${final_loss:-}", "train_s": $((t2 - t1)),
           "tests_exit": $tests_rc, "tests": "$summary", "tests_s": $((t3 - t2)),
           "load_avg": open("/proc/loadavg").read().split()[:3]}, open(sys.argv[1], "w"), indent=1)
EOF
echo "| $VERSION | $versions | ${final_loss:-fail} ($((t2 - t1)) s) | $summary | $((t3 - t2)) s |"
[ $train_rc -eq 0 ] && [ $tests_rc -eq 0 ]
