#!/usr/bin/env bash
# The GPU checklist in one call, for a short loan of one H100/H200 with torch preinstalled and no network
# (docs/training.md, "The LM-head loss and the GPU step benchmark"; about 3 minutes on an H200; the steps'
# limits add up to 285 s after the facts line).
#
#   scripts/gpu_check.sh OUT_DIR [WHEEL_DIR]     # on the GPU box; WHEEL_DIR: wheels to install first (offline)
#   FLEXSP_GPU_CHECK_CPU=1 scripts/gpu_check.sh /tmp/rehearsal   # the same steps on a CPU, quick modes (CI)
#
# In order (correctness first), each under its own time limit; a step that fails or runs out of time is
# recorded and the next one still runs:
#   0. facts:    what the box has, in one line (scripts/gpu_facts.py: packages, what varlen_attn offers)
#   1. tests:    explicit test files that import only torch, pytest and flexsp (no hypothesis):
#                the real-CUDA kernels (padding after a poisoned allocator, which kernel ran), fake-CUDA paths
#   2. selftest: flexsp selftest --device cuda (kernels, step vs plain loop, memory, host syncs)
#   3. gpu_step: experiments/gpu_step_benchmark.py --budget-s 60 (issue 36's targets; sizes itself to the GPU)
#   4. ranks:    scripts/shared_gpu_ranks.py: 4 processes on the one GPU over gloo with CUDA tensors, a planned
#                step at SP degrees 2 and 4 against one process (gloo does not carry send/recv: no ring there)
# OUT_DIR gets at most 6 files: summary.txt, facts.json, selftest.json, gpu_step.json, ranks.json, logs.tgz.
# The exit code is the number of steps that did not pass.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR [WHEEL_DIR]}"
WHEELS="${2:-}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
CPU="${FLEXSP_GPU_CHECK_CPU:-}"
failed=0

if [ -n "$WHEELS" ]; then   # offline: install what the box lacks from the wheels given, into a folder of its own
    SITE="${FLEXSP_GPU_CHECK_SITE:-/tmp/flexsp-gpu-site}"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl >"$OUT/logs/wheels.log" 2>&1; then
        echo "wheels: could not install from $WHEELS (see logs/wheels.log); going on with what the box has" \
            | tee -a "$OUT/summary.txt"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

step() {   # step NAME SECONDS COMMAND...
    local name="$1" limit="$2"; shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
    local rc=$?
    local last
    last="$(grep -E '^(pass: |FAILED|[0-9]+ (passed|failed)|=+ .*(passed|failed|error)|  [a-z -]+  (pass|FAIL|skip) |- .*(met|MISSED)$|tiny group: )' \
            "$OUT/logs/$name.log" | tail -n 12)"
    printf '%-9s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - started))" "$*" | tee -a "$OUT/summary.txt"
    [ -n "$last" ] && printf '%s\n' "$last" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 124 ] && echo "    (ran out of its $limit s)" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

# --- 0. facts: one line saying what is there and what is missing -----------------------------------------
"$PY" scripts/gpu_facts.py "$OUT/facts.json" ${CPU:+--cpu} 2>"$OUT/logs/facts.log" | tee -a "$OUT/summary.txt"
facts_rc=${PIPESTATUS[0]}
if [ "$facts_rc" -ne 0 ]; then
    echo "facts: rc=$facts_rc - nothing else can run" | tee -a "$OUT/summary.txt"
    tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
    exit 5
fi

# --- 1. tests: explicit files, GPU-relevant tests only (property tests need hypothesis and no GPU) --------
TESTS=(tests/runtime/test_cuda_real.py tests/runtime/test_cuda_fake.py tests/runtime/test_kernel_dispatch.py
       tests/runtime/test_hostile_kernels.py tests/runtime/test_loss.py tests/runtime/test_fused_loss.py
       tests/profile/test_selftest_cuda_fake.py)
SELECT="${FLEXSP_GPU_CHECK_SELECT:-cuda or varlen or cudnn or idle or report or rule or signature}"   # override: CI's rehearsal
TEST_LIMIT=60; [ -n "$CPU" ] && TEST_LIMIT=600   # a loaded CI CPU is slower than the GPU box's 16 cores
if have pytest; then
    step tests "$TEST_LIMIT" "$PY" -m pytest -p no:cacheprovider -rfEs "${TESTS[@]}" -k "$SELECT"
else
    echo "tests     skipped: pytest is missing" | tee -a "$OUT/summary.txt"; failed=$((failed + 1))
fi

# --- 2.-4. ---------------------------------------------------------------------------------------------------
if [ -n "$CPU" ]; then
    step selftest 240 "$PY" -m flexsp selftest --device cpu --repeats 1 --output "$OUT/selftest.json"
    step gpu_step 240 "$PY" experiments/gpu_step_benchmark.py --quick --output "$OUT/gpu_step.json"
    step ranks 300 "$PY" scripts/shared_gpu_ranks.py --device cpu --timeout 280 --output "$OUT/ranks.json"
else
    step selftest 60 "$PY" -m flexsp selftest --device cuda --output "$OUT/selftest.json"
    step gpu_step 90 "$PY" experiments/gpu_step_benchmark.py --budget-s 60 --output "$OUT/gpu_step.json"
    step ranks 75 "$PY" scripts/shared_gpu_ranks.py --device cuda --timeout 70 --output "$OUT/ranks.json"
fi
echo "steps not passed: $failed (results in $OUT; logs in logs.tgz)" | tee -a "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit "$failed"
