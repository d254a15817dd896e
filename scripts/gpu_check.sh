#!/usr/bin/env bash
# The GPU checklist in one call, for a short loan of one H100/H200 (docs/training.md, "The LM-head loss and the GPU step benchmark").
#
#   scripts/gpu_check.sh OUT_DIR            # on the GPU machine: every check, each under its own time limit
#   FLEXSP_GPU_CHECK_CPU=1 scripts/gpu_check.sh /tmp/rehearsal   # the same steps on a CPU, quick modes (rehearsal)
#
# In order (correctness first; each step's output goes to OUT_DIR/<step>.log, results next to it):
#   1. the CUDA tests:              pytest -k "cuda or varlen"           (padding rows, kernels, fake-CUDA paths)
#   2. flexsp selftest --device cuda                                      (kernels, step vs plain loop, memory, syncs)
#   3. experiments/gpu_step_benchmark.py                                  (issue 36's targets, results JSON)
# A step that fails or runs out of time is recorded and the next one still runs; the exit code is the number
# of steps that did not pass. The profile and the replay (experiments/gpu_replay.py) take their own call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CPU="${FLEXSP_GPU_CHECK_CPU:-}"
failed=0

step() {   # step NAME SECONDS COMMAND...
    local name="$1" limit="$2"; shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - started))" "$*" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

"$PY" - <<'EOF' | tee "$OUT/summary.txt"
import platform, torch
cuda = torch.cuda.is_available()
print("device:", torch.cuda.get_device_name() if cuda else f"CPU {platform.machine()}", "| torch", torch.__version__,
      "| cuda", torch.version.cuda)
EOF
if [ -n "$CPU" ]; then
    step tests 600 "$PY" -m pytest -q -x tests/runtime/test_hostile_kernels.py tests/runtime/test_cuda_fake.py
    step selftest 300 "$PY" -m flexsp selftest --device cpu --output "$OUT/selftest.json"
    step gpu_step 300 "$PY" experiments/gpu_step_benchmark.py --quick --output "$OUT/gpu_step.json"
else
    step tests 150 "$PY" -m pytest -q tests -k "cuda or varlen"
    step selftest 150 "$PY" -m flexsp selftest --device cuda --output "$OUT/selftest.json"
    step gpu_step 270 "$PY" experiments/gpu_step_benchmark.py --budget-s 220 --output "$OUT/gpu_step.json"
fi
echo "steps not passed: $failed (logs and results in $OUT)" | tee -a "$OUT/summary.txt"
exit "$failed"
