#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go, on a machine where raysinga is installed with its
# test and bench extras and CuPy:
#
#     benchmarks/gpu_checks.sh [OUT] [SECONDS] [PART ...]
#
# In order of importance: the CUDA graph tests, the `gpu` tests, the kernel benchmark, the step
# benchmark's GPU side (MLP, CNN, character model; eager, recorded as CUDA graphs, and the PyTorch
# peers eager and compiled), the eager step's host waits (profile_step.py), then training with the
# GPU: the README's job on one process, a distributed run with GPU workers and one with a GPU
# server too, the job with graphs, the distributed benchmark on one shared GPU, and recovery of
# lost GPU roles (each kind of loss timed, then chaos). Each part runs under its own time limit
# (SECONDS, default 150; the tests get twice that) so one that hangs does not take the others'
# time. Without a usable GPU it stops at once, saying why. Each part's output goes to OUT (default
# gpu-results/) as NAME.log, with the benchmarks' figures as JSON files named as
# benchmarks/results/ names them (copy them there and run `python benchmarks/report.py docs
# docs/benchmarks.md` to show them); OUT/summary.txt lists every part's exit status and seconds.
# The script exits non-zero when any part failed. Naming PARTs (as the summary names them:
# graph-tests, gpu-tests, bench-kernels, bench-step-mlp, bench-step-cnn, bench-step-charlm,
# profile-step, bench-precision, train-local, train-gpu-workers, train-gpu-server,
# train-local-graphs, bench-distributed-gpu, bench-recovery-gpu, chaos-gpu) runs only those, in
# that order.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
limit=${2:-150}
only=" ${*:3} "  # the parts asked for (all where none is named)
py=${PYTHON:-python}
mkdir -p "$out"
: > "$out/summary.txt"
failed=0

part() {  # part NAME SECONDS COMMAND...: run COMMAND with a limit, log it, note its status
  local name=$1 secs=$2
  shift 2
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then
    return 0
  fi
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$out/summary.txt"
  timeout --kill-after=10 "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed=1
  local note=""
  [ "$rc" -eq 124 ] && note=" (ran past its ${secs} s)"
  echo "   exit $rc after $((SECONDS - t0)) s$note" | tee -a "$out/summary.txt"
  tail -n 3 "$out/$name.log" | sed 's/^/   | /' | tee -a "$out/summary.txt"
}

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import cupy; print("CuPy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())'
  "$py" -c 'from raysinga.kernels import gpu_available, gpu_unavailable_reason as r; print("usable GPU:", gpu_available() or r())'
} > "$out/device.txt" 2>&1
cat "$out/device.txt"
if ! "$py" -c 'import sys; from raysinga.kernels import gpu_available; sys.exit(not gpu_available())'; then
  echo "no usable GPU here (see $out/device.txt): nothing to check" | tee -a "$out/summary.txt"
  exit 1
fi

part graph-tests "$limit" "$py" -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_gpu_blas.py tests/kernels/test_gpu_attention.py tests/run/test_graph_step.py \
  --junitxml="$out/graph-tests.xml"
part gpu-tests $((2 * limit)) "$py" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$out/gpu-tests.xml"
part bench-kernels "$limit" "$py" benchmarks/bench_kernels.py --json "$out/bench_kernels.json"
for model in mlp cnn charlm; do
  part "bench-step-$model" "$limit" "$py" benchmarks/bench_step.py --model "$model" \
    --device gpu --rounds 3 --json "$out/bench_step_${model}_gpu.json"
done
part profile-step "$limit" "$py" benchmarks/profile_step.py --rounds 3 \
  --json "$out/profile_step.json"
part bench-precision $((2 * limit)) "$py" benchmarks/bench_precision.py --rounds 3 \
  --json "$out/bench_precision.json"
runs=$(mktemp -d)
job=examples/digits_mlp.yaml
part train-local "$limit" env RAYSINGA_DEVICE=gpu "$py" -m raysinga.cli train "$job" --local \
  --set "run_dir=$runs/local"
part train-gpu-workers "$limit" env RAYSINGA_DEVICE=gpu "$py" -m raysinga.cli train "$job" \
  --address local --set "run_dir=$runs/workers" --set "topology.worker.gpus=0.5"
part train-gpu-server "$limit" env RAYSINGA_DEVICE=gpu "$py" -m raysinga.cli train "$job" \
  --address local --set "run_dir=$runs/server" --set "topology.worker.gpus=0.25" \
  --set "topology.server.gpus=0.25"
part train-local-graphs "$limit" env RAYSINGA_DEVICE=gpu RAYSINGA_GPU_GRAPHS=strict \
  "$py" -m raysinga.cli train "$job" --local --set "run_dir=$runs/graphs"
part bench-distributed-gpu "$limit" "$py" benchmarks/bench_distributed.py --device gpu \
  --rounds 3 --json "$out/bench_distributed_gpu.json"
part bench-recovery-gpu "$limit" "$py" benchmarks/bench_recovery.py --device gpu --runs 3 \
  --json "$out/bench_recovery_gpu.json"
part chaos-gpu "$limit" "$py" benchmarks/chaos.py examples/digits_mlp.yaml --device gpu \
  --kills 10 --steps 1500 --json "$out/chaos_gpu.json"
rm -rf "$runs"
echo "every part's log and figures: $out/ (summary: $out/summary.txt)"
exit "$failed"
