#!/usr/bin/env bash
# Every benchmark a CPU machine can run, one after another, each writing its figures to
# RESULTS/NAME.json (default benchmarks/results/), then the tables of docs/benchmarks.md drawn
# anew from them:
#
#     benchmarks/cpu_checks.sh [RESULTS]
#
# Needs raysinga installed with its bench, examples and plot extras. Run it with nothing else
# loading the machine: the figures are ratios against peers timed in the same run, but a busy
# machine widens their spread. It takes about an hour on two cores. Each benchmark's output goes
# to RESULTS/NAME.log; the script exits non-zero when any benchmark failed (a goal not met is
# not a failure: the tables say so).
set -u
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
py=${PYTHON:-python}
mkdir -p "$out"
failed=0

bench() {  # bench NAME SCRIPT ARGS...: run benchmarks/SCRIPT with --json RESULTS/NAME.json
  local name=$1 script=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: $script $*"
  "$py" "benchmarks/$script" "$@" --json "$out/$name.json" > "$out/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "   exit $rc after $((SECONDS - t0)) s"
}

bench bench_wakeup bench_wakeup.py
for model in mlp cnn charlm; do
  bench "bench_step_$model" bench_step.py --model "$model" --device cpu
done
bench bench_distributed bench_distributed.py --rounds 3
bench bench_distributed_spares bench_distributed.py --spares-rounds 3 --warmup 80 --steps 100
bench bench_distributed_replay bench_distributed.py --replay-rounds 3 --warmup 80 --steps 100
bench bench_checkpoint bench_checkpoint.py --rounds 5
bench bench_checkpoint_async bench_checkpoint_async.py
bench bench_async bench_async.py --also-none --out "$(mktemp -d)"
bench bench_recovery bench_recovery.py
bench chaos chaos.py --kills 20 --seed 1
bench bench_tune bench_tune.py --rounds 3
"$py" benchmarks/report.py docs docs/benchmarks.md
exit "$failed"
