#!/usr/bin/env bash
# Run every benchmark (2 ranks each, CPU or GPU), then write benchmarks/PERFORMANCE.md from the results
# (benchmarks/render_report.py) and the README's performance table.
# Usage: benchmarks/run_all.sh [extra args passed to every multi-engine script, e.g. --no-memory]
# PYTHON overrides the interpreter (default: .venv/bin/python if present, else python).
# QUICK=1: fewer steps and smaller sizes, results and report in benchmarks/results/quick/ (the committed
# results and PERFORMANCE.md are left alone).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
python_has_cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
if [ "$python_has_cuda" = "0" ]; then export DS_ACCELERATOR=cpu; fi
if [ "${QUICK:-0}" = "1" ]; then
  export BENCH_RESULTS="$PWD/benchmarks/results/quick"
  common=(--steps 3 --warmup 1 --no-memory)
  declare -A extra=(
    [overhead]="--quick" [overhead_watchdog]="--watchdog" [peers]="--sizes small" [parts]="--sizes small --dtypes fp32"
    [memory_breakdown]="--sizes small --dtypes fp32" [growth]="--engines 1 2 --stages alt --dims"
    [counts]="--engines 2 --stages alt --no-rlhf" [dpo_roles]="--size small"
    [fused_reduce]="--quick" [fused_reduce_e2e]="--steps 3 --layers 50 --stages 2" [generation]="--new-tokens 8")
  # The short run leaves out the slowest extras (two of the three reliability runs, the large-model ZeRO-3 update
  # view and the single-engine features' on/off runs): its report says "not measured" there.
  extras=(overhead_watchdog)
  readme=()
else
  export BENCH_RESULTS="$PWD/benchmarks/results"
  common=()
  declare -A extra=(
    [overhead]="--dtypes fp32 bf16 --steps 100" [overhead_watchdog]="--watchdog --steps 30"
    [overhead_meet]="--meet --steps 60" [overhead_rank_agreement]="--rank-agreement --dtypes fp32 bf16 --steps 60"
    [memory_breakdown]="--repeat 5 --at-peak" [growth]="--upstream"
    [overhead_overflow_by_norm]="--overflow-by-norm --dtypes fp32 bf16 --steps 60"
    [overhead_bucket_size]="--bucket-size --dtypes fp32 bf16" [overhead_lazy_grads]="--lazy-grads --dtypes fp32 bf16"
    [overhead_cast_on_gather]="--cast-on-gather --dtypes bf16 --steps 40" [overhead_block_sizes]="--block-sizes --steps 40"
    [overhead_block_floor]="--block-floor --steps 40"
    [overhead_rank_order]="--rank-order --steps 40" [generation]="--steps 5 --warmup 1")
  extras=(overhead_watchdog overhead_meet overhead_rank_agreement zero3_grad_view overhead_overflow_by_norm
          overhead_bucket_size overhead_lazy_grads overhead_cast_on_gather overhead_block_sizes overhead_block_floor
          overhead_rank_order)
  readme=(--readme README.md)
fi
mkdir -p "$BENCH_RESULTS"
# A result this run does not make (bf16 left out on a CPU without bf16 kernels) must not be rendered from an
# earlier run on another machine: the report holds this run's files only (git keeps the earlier ones).
find "$BENCH_RESULTS" -maxdepth 1 -type f \( -name '*.json' -o -name '*.txt' -o -name '*.png' \) -delete
summary="$BENCH_RESULTS/summary.txt"
: > "$summary"
bench_start=$(date +%s)
timings=()  # name=seconds, for bench_time.json (how long this command takes, shown in the report)
run() {  # run <log name> <script> [args...]
  local name=$1 script=$2; shift 2
  echo "=== benchmarks/$script.py $*"
  local start; start=$(date +%s)
  "$PY" "benchmarks/$script.py" "$@" | tee "$BENCH_RESULTS/$name.txt"
  local took=$(( $(date +%s) - start ))
  echo "($name: $took s)"
  timings+=("$name=$took")
  grep '^RESULT' "$BENCH_RESULTS/$name.txt" >> "$summary" || true
}
for b in overhead "${extras[@]}" two_engines distillation rlhf_step peers memory_breakdown parts growth counts dpo_roles \
    generation; do
  case $b in overhead_*) script=overhead ;; *) script=$b ;; esac  # overhead_<feature>: overhead.py --<feature>
  # shellcheck disable=SC2086
  run "$b" "$script" "${common[@]}" ${extra[$b]:-} "$@"
done
# The fused-op benchmarks take their own options, so the common and extra arguments are not passed to them.
# shellcheck disable=SC2086
run fused_reduce fused_reduce ${extra[fused_reduce]:-}
# shellcheck disable=SC2086
run fused_reduce_e2e fused_reduce_e2e ${extra[fused_reduce_e2e]:-}
"$PY" benchmarks/_bench.py --write-time "$BENCH_RESULTS/bench_time.json" "$(( $(date +%s) - bench_start ))" \
  "${QUICK:-0}" "${timings[@]}"
"$PY" benchmarks/render_report.py --results "$BENCH_RESULTS" "${readme[@]}"
echo "=== summary"
cat "$summary"
