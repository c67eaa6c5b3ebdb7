"""CI's guard of the hot paths: short runs of two benchmarks, judged on ratios measured in the
same run (never on absolute times, which differ from machine to machine and day to day).

- ``bench_recovery.py --kinds worker,server --runs 3``: a lost worker and a lost server each
  come back at least ``RECOVERY_GAIN`` times faster on the default path (replaced alone) than
  on the restart path (every role restarted from a checkpoint). A role's start-up is on the
  default path (its spare loads while the run trains, and a replacement without one starts a
  process): a heavy import there once made a replacement 5x slower for nine days unseen.
- ``bench_distributed.py --rounds 1 --no-peer``: raysinga's samples/s at least
  ``VS_LOCAL`` of its single-process run (the benchmark's goal is 0.85x; CI's floor leaves
  room for a busy machine).

A check that fails is run once more, and fails the guard only where it fails again: one noisy
round on a shared machine is not a regression, the same ratio twice is::

    python benchmarks/ci_guard.py [--out DIR]

Prints one line per check and exits 1 where any fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECOVERY_GAIN = 3.0  # the restart path's time over the default path's, at least
VS_LOCAL = 0.75  # raysinga's samples/s over the single process's, at least
TIMEOUT_S = 900


def figures(path: Path) -> dict[str, dict]:
    return {f["name"]: f for f in json.loads(path.read_text())["figures"]}


def run(script: str, args: list[str], out: Path) -> tuple[dict[str, dict] | None, str]:
    """One benchmark's figures, and its output's tail where it failed to give them."""
    env = {**os.environ, "RAYSINGA_DEVICE": "cpu"}
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"{script} ran past {TIMEOUT_S} s"
    if done.returncode != 0 or not out.exists():
        return None, f"{script} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
    return figures(out), ""


def recovery(out: Path) -> list[tuple[str, float | None, float]]:
    found, why = run("bench_recovery.py", ["--kinds", "worker,server", "--runs", "3"], out)
    checks = []
    for kind in ("worker", "server"):
        f = (found or {}).get(f"{kind} lost: restart path's time / default path's")
        checks.append(
            (f"{kind} lost: restart path / default path", f and f["value"], RECOVERY_GAIN)
        )
    if why:
        print(why)
    return checks


def distributed(out: Path) -> list[tuple[str, float | None, float]]:
    found, why = run("bench_distributed.py", ["--rounds", "1", "--no-peer"], out)
    f = (found or {}).get("ratio raysinga / single process")
    if why:
        print(why)
    return [("raysinga / single process, samples/s", f and f["value"], VS_LOCAL)]


def judged(name: str, measure: Callable[[Path], list], out: Path) -> bool:
    """Run ``measure``; where a check fails, run it once more. True where every check held
    (in either try)."""
    for attempt in (1, 2):
        checks = measure(out / f"{name}-{attempt}.json")
        failed = [c for c in checks if c[1] is None or c[1] < c[2]]
        for label, value, floor in checks:
            got = "no figure" if value is None else f"{value:.2f}x"
            verdict = "ok" if value is not None and value >= floor else "FAILED"
            print(f"ci_guard: {label}: {got} (at least {floor:.2f}x): {verdict}", flush=True)
        if not failed:
            return True
        if attempt == 1:
            print(f"ci_guard: {name}: run once more", flush=True)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="where the benchmarks' JSON files go")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ci-guard-"))
    out.mkdir(parents=True, exist_ok=True)
    ok = judged("recovery", recovery, out)
    ok = judged("distributed", distributed, out) and ok
    print(f"ci_guard: {'every check held' if ok else 'a check failed twice'} ({out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
