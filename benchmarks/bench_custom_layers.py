"""What a layer of the user's own costs for going through the public layer interface: the
example language model of ``examples/charlm.yaml`` (4 blocks of width 128, context 128, batch
32) on the CPU, once with raysinga's own ``layernorm`` and once with the same normalisation
written by the user (``mylayers:UserLayerNorm`` of ``examples/custom_layers/mylayers.py``,
named by import path, through the public kernels), in one run::

    python benchmarks/bench_custom_layers.py [--steps 20] [--rounds 7]

A step is forward, backward and the parameter update (SGD with momentum) on data already in
memory. The two sides take turns round by round (``bench_step.alternate``); the ratio is taken
of the medians, with the lowest and highest of the rounds' own ratios. Goal: the user's at
most 1.05x the step time of raysinga's own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import bench_step  # noqa: I001 - sets the BLAS threads' defaults before NumPy loads
from report import Figure, Report, add_json_option

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_layers"
GOAL = 1.05


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per side, alternating")
    add_json_option(ap)
    a = ap.parse_args()
    sys.path.insert(0, str(EXAMPLE))  # as the job's `modules` puts it on the path

    own, batch = bench_step.charlm_spec()
    user = {
        **own,
        "layers": [
            {**ly, "kind": "mylayers:UserLayerNorm"} if ly["kind"] == "layernorm" else ly
            for ly in own["layers"]
        ],
    }
    swapped = sum(ly["kind"] == "layernorm" for ly in own["layers"])
    print(
        f"charlm ({bench_step.CHARLM_YAML.name}), batch {batch} x 128 characters, float32, on "
        f"the CPU: its {swapped} layer norms raysinga's own, or the user's own"
    )
    data = bench_step.batches(8, batch, (128,), tokens=True)
    sides = [bench_step.Ours("cpu", data, own), bench_step.Ours("cpu", data, user)]
    ours, theirs = bench_step.alternate(sides, a.steps, a.rounds)
    report = Report("bench_custom_layers", vars(a))
    report.add(Figure("raysinga's layernorm: step", [t * 1e3 for t in ours], " ms"), ".2f")
    report.add(Figure("the user's layer norm: step", [t * 1e3 for t in theirs], " ms"), ".2f")
    ratios = [u / o for u, o in zip(theirs, ours, strict=True)]
    report.add(
        Figure(
            "the user's / raysinga's step time",
            ratios,
            "x",
            goal=GOAL,
            value=statistics.median(theirs) / statistics.median(ours),
        ),
        ".3f",
    )
    report.write(a.json)


if __name__ == "__main__":
    main()
