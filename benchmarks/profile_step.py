"""Where an eager GPU step waits for the host: the step of bench_step.py's models (MLP, CNN,
charlm) profiled with ``torch.profiler``, which records CuPy's CUDA calls and kernels as it
records PyTorch's (CUPTI sees every call of the process).

    pip install -e '.[bench,gpu]'
    python benchmarks/profile_step.py [--model mlp|cnn|charlm|all] [--steps 20] [--rounds 3]
        [--trace DIR] [--json FILE]

Each round runs ``--steps`` steps (forward, backward, the update; data already on the device, as
bench_step.py's) under the profiler, after a warm-up, and counts the calls that make the host
wait for the GPU: stream, event and device synchronisations, and copies to the host (a
``cudaMemcpy`` without ``Async`` waits, and a device-to-host one is a read of a result). Figures
per model: those waits per step (goal 0: the trainer reads the loss every 32 steps, outside the
step), and the step's wall time over the GPU's busy time in the same steps (the union of the
kernels' and copies' intervals; goal at most 1.2: the host keeps ahead of the GPU). ``--trace``
writes each model's Chrome trace for a closer look. Prints "not measured" where no GPU or no
PyTorch with CUDA is usable.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_step import MODELS, Ours, batches
from report import Figure, Report, add_json_option

from raysinga import kernels as K

WAIT_GOAL = 0.0  # host waits per step, at most
BUSY_GOAL = 1.2  # the step's wall time over the GPU's busy time, at most


def waits_of(name: str) -> bool:
    """A CUDA call that blocks the host until the GPU is done with earlier work."""
    if "Synchronize" in name:
        return True
    return name.startswith(("cudaMemcpy", "cuMemcpy")) and "Async" not in name


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (microseconds in, seconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def model(name: str) -> tuple[dict, list]:
    """``(spec, batches)`` of bench_step.py's model ``name``, as its comparison makes them."""
    spec_batch, shape, _ = MODELS[name]
    spec, batch = spec_batch()
    return spec, batches(8, batch, shape, tokens=name == "charlm")


def profile_round(torch, ours: Ours, steps: int, trace: str | None) -> tuple[float, float, dict]:
    """``(waits per step, wall / GPU busy, {wait call: count})`` of ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            ours.step()
        ours.xp.cuda.Device().synchronize()
        wall = time.perf_counter() - t0
    waits: dict[str, int] = {}
    gpu: list[tuple[float, float]] = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append((ev.time_range.start, ev.time_range.end))
        elif waits_of(ev.name):
            waits[ev.name] = waits.get(ev.name, 0) + 1
    if trace:
        prof.export_chrome_trace(trace)
    busy = busy_seconds(gpu)
    return sum(waits.values()) / steps, (wall / busy if busy else float("inf")), waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["mlp", "cnn", "charlm", "all"], default="all")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace", metavar="DIR", default=None, help="Chrome traces here")
    add_json_option(ap)
    args = ap.parse_args()
    if not K.gpu_available():
        print(f"not measured: no usable GPU ({K.gpu_unavailable_reason()})")
        return
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print(
            "not measured: no PyTorch with CUDA, whose profiler this is (pip install -e '.[bench]')"
        )
        return
    report = Report("profile_step", vars(args))
    for name in ("mlp", "cnn", "charlm") if args.model == "all" else (args.model,):
        spec, data = model(name)
        ours = Ours("gpu", data, spec)
        ours.steps(5)  # warm-up: kernels compiled, memory pooled
        per_step, ratios, seen = [], [], {}
        for r in range(args.rounds):
            trace = f"{args.trace}/{name}-{r}.json" if args.trace else None
            w, ratio, calls = profile_round(torch, ours, args.steps, trace)
            per_step.append(w)
            ratios.append(ratio)
            for k, v in calls.items():
                seen[k] = seen.get(k, 0) + v
        print(f"  {name}: the waiting calls over {args.rounds} rounds: {seen or 'none'}")
        report.add(Figure(f"{name}: host waits per eager step", per_step, "", WAIT_GOAL), ".2f")
        report.add(
            Figure(f"{name}: eager step, wall / GPU busy time", ratios, "x", BUSY_GOAL), ".2f"
        )
        print(f"    (median of {statistics.median(ratios):.2f}x over {args.rounds} rounds)")
    report.write(args.json)


if __name__ == "__main__":
    main()
