#!/usr/bin/env bash
# Run every benchmark (2 ranks each, CPU or GPU), then write benchmarks/PERFORMANCE.md from the
# results. Usage: benchmarks/run_all.sh [extra args passed to every script, e.g. --no-memory]
# PYTHON overrides the interpreter (default: .venv/bin/python if present, else python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
python_has_cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
if [ "$python_has_cuda" = "0" ]; then export DS_ACCELERATOR=cpu; fi
mkdir -p benchmarks/results
summary=benchmarks/results/summary.txt
: > "$summary"
for b in overhead zero3_grad_view two_engines distillation rlhf_step peers memory_breakdown parts growth counts dpo_roles; do
  echo "=== benchmarks/$b.py $*"
  start=$(date +%s)
  "$PY" benchmarks/$b.py "$@" | tee benchmarks/results/$b.txt
  echo "($b: $(( $(date +%s) - start )) s)"
  grep '^RESULT' benchmarks/results/$b.txt >> "$summary"
done
# The fused-op benchmarks take their own options, so the extra arguments are not passed to them.
for b in fused_reduce fused_reduce_e2e; do
  echo "=== benchmarks/$b.py"
  start=$(date +%s)
  "$PY" benchmarks/$b.py | tee benchmarks/results/$b.txt
  echo "($b: $(( $(date +%s) - start )) s)"
  grep '^RESULT' benchmarks/results/$b.txt >> "$summary"
done
"$PY" benchmarks/report.py
echo "=== summary"
cat "$summary"
