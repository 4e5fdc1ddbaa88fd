#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the benchmarks; a short table prints last.
# Usage (device machine, repo root): bash scripts/gpu_check.sh [quick]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PWD}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/snapmla_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "== GPU tests"
python3 -m pytest -q -m gpu tests/gpu -x --timeout=900 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
echo "== prep benchmark"
[ -f scripts/bench_prep.py ] && python3 scripts/bench_prep.py --json "$OUT/bench_prep.json" 2>&1 | tee "$OUT/bench_prep.log" | tail -20
echo "== decode benchmark"
if [ "${1:-}" = quick ]; then
  python3 scripts/bench_decode.py --heads 16,128 --mtp 1 --ctx 32768 --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log"
else
  python3 scripts/bench_decode.py --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log"
fi
