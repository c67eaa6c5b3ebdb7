"""``bench_distributed.py --hosts N --link RATE[,RATE...]``: raysinga against Ray Train's
TorchTrainer (DDP over gloo) on emulated hosts that share nothing but a network of finite
bandwidth (``tests/hosts.py``: Linux namespaces on this machine; needs root and iproute2).

A head that holds no role (Ray's head and the drivers) and ``N`` hosts of ``--host-cpus`` CPUs,
every link shaped to RATE Mbit/s each way (a token bucket at both ends). Both sides train the
MLP of ``bench_distributed.py`` (784-1024-1024-10, float32: P = 7.5 MB of parameters) on the
same synthetic data (on a directory every host mounts) at the same global batch, one worker of
``--host-cpus`` CPUs on each host:

- raysinga, one synchronous group of N workers in each topology of ``--topologies``:
  ``sandblaster`` (the servers where placement puts them, ``--servers`` of them),
  ``allreduce`` (one server beside each worker, the stub summing every worker's gradient),
  ``hosts`` (the allreduce preset summed by hosts, ``topology.reduce: hosts``: per host a step
  moves what ring allreduce moves), ``hosts-bf16`` (the same with ``topology.wire: bf16``),
  ``hosts-zstd`` and ``hosts-bf16-zstd`` (``wire: f32+zstd``, ``bf16+zstd``: the same
  words compressed without loss), and ``hosts-delta`` and ``hosts-bf16-delta`` (``wire:
  f32+delta``, ``bf16+delta``: only the values' differences from the last ones compressed);
- DDP over gloo, float32; and DDP with its bf16 compression hook (``bf16_compress_hook``: the
  gradients cross as bfloat16).

The sides take turns within each round. For each: samples/s over the timed steps, and the bytes
per step of the busiest host, out and in, read off the hosts' interfaces, beside ring
allreduce's 2·(N-1)/N·P each way. raysinga's bytes are the interfaces' between the reports
that open and close the timed steps (nothing of a step in flight); DDP's are its whole run's
divided by its steps (its start and its first broadcast of the parameters included: a share of
about 1/steps of P on top). Each raysinga round also prints its mean step by phase (the
reports' ``ms``, as in ``metrics.jsonl``: where the step goes). Goals (``docs/benchmarks.md``):
the best topology that sends float32's every bit at least 1.0x DDP's samples/s at every rate;
``hosts``' busiest host at most 1.1x ring allreduce's bytes; ``hosts-bf16`` 0.5x ``hosts``'
bytes (within 5%); and at the slowest rate, the best of the bf16 sides at least 1.6x DDP's
samples/s and 1.0x DDP's with its bf16 hook.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import Figure, Report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the emulated hosts are the suite's

TOPOLOGIES = (
    "sandblaster",
    "allreduce",
    "hosts",
    "hosts-bf16",
    "hosts-zstd",
    "hosts-bf16-zstd",
    "hosts-delta",
    "hosts-bf16-delta",
)
_HOSTS = ["topology.preset=allreduce", "topology.reduce=hosts"]
# the topology keys each side sets beyond the preset's
SIDE_SETS = {
    "hosts": _HOSTS,
    "hosts-bf16": [*_HOSTS, "topology.wire=bf16"],
    "hosts-zstd": [*_HOSTS, "topology.wire=f32+zstd"],
    "hosts-bf16-zstd": [*_HOSTS, "topology.wire=bf16+zstd"],
    "hosts-delta": [*_HOSTS, "topology.wire=f32+delta"],
    "hosts-bf16-delta": [*_HOSTS, "topology.wire=bf16+delta"],
}
BF16 = ("hosts-bf16", "hosts-bf16-zstd", "hosts-bf16-delta")  # the sides whose values cross rounded
GOAL_RING = 1.1  # hosts: the busiest host's bytes per step over ring allreduce's
GOAL_BF16_BYTES = (0.475, 0.525)  # hosts-bf16's bytes over hosts'
GOAL_BF16_VS_DDP = 1.6  # hosts-bf16 at the slowest rate, over DDP float32's samples/s
SHARED = "/mnt/shared"
RESULT = "@result "  # the line a driver on the head prints its figures on
DISP = 10  # raysinga's progress reports: the timed steps start and end at one
GOAL_VS_DDP = 1.0


def raysinga_run(address: str, job: str, sets: list[str], warmup: int, steps: int) -> None:
    """A driver on the head (:func:`hosts.drive`): trains ``job``, reading the hosts'
    interface counters at the reports of steps ``warmup`` and ``warmup + steps``; prints the
    seconds between them, the counters and the run's own count of its bytes."""
    import hosts  # noqa: PLC0415
    import ray  # noqa: PLC0415

    from raysinga import config  # noqa: PLC0415
    from raysinga.distributed import DistributedTrainer  # noqa: PLC0415
    from raysinga.obs.events import TrainStep  # noqa: PLC0415

    ray.init(address=address, log_to_driver=False)
    lab = hosts.RemoteCluster()
    t = DistributedTrainer(config.load(job, sets), log=None)
    marks: dict[Any, Any] = {"ms": []}

    def hook(ev) -> None:
        if isinstance(ev, TrainStep) and ev.step in (warmup, warmup + steps):
            marks[ev.step] = {"t": time.perf_counter(), "counters": lab.counters(), "net": ev.net}
        if isinstance(ev, TrainStep) and warmup < ev.step <= warmup + steps:
            marks["ms"].append(ev.ms)  # the phases of the timed steps' reports

    t.hub.subscribe(hook)
    t.fit()
    print(RESULT + json.dumps(marks), flush=True)


def ddp_run(address: str, loop_config: dict, workers: int, cpus: int) -> None:
    """A driver on the head: Ray Train's TorchTrainer, one worker per host (``SPREAD``), gloo
    over the hosts' own interface."""
    import os  # noqa: PLC0415

    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    import ray  # noqa: PLC0415
    from bench_distributed import torch_loop  # noqa: PLC0415
    from ray.train import RunConfig, ScalingConfig  # noqa: PLC0415
    from ray.train.torch import TorchTrainer  # noqa: PLC0415

    # every host's interface is eth0 (gloo would otherwise pick one by the host name), and the
    # checkout is at the same path on each: the train loop is imported from this directory
    env = {"GLOO_SOCKET_IFNAME": "eth0", "RAY_TRAIN_V2_ENABLED": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent)
    ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env})
    name = Path(loop_config["out"]).stem
    TorchTrainer(
        torch_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=workers, resources_per_worker={"CPU": cpus}, placement_strategy="SPREAD"
        ),
        run_config=RunConfig(storage_path=f"{SHARED}/ray-train", name=name),
    ).fit()


def job_yaml(xp: str, yp: str) -> str:
    from bench_distributed import BATCH, MODEL  # noqa: PLC0415

    return json.dumps(
        {
            "name": "bench-hosts",
            "seed": 0,
            "model": MODEL,
            "data": {"source": {"kind": "npy", "x": xp, "y": yp}, "batch_size": BATCH},
            "updater": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "disp_freq": DISP,
            "test_freq": 0,
            "checkpoint_frequency": 0,
            "checkpoint": {"final": False},
        }
    )


def busiest(a: dict, b: dict, steps: int, among: set[str]) -> tuple[float, float]:
    """Bytes per step out and in of the busiest of the hosts ``among``, from two readings of
    every host's counters."""
    out = max((b[h]["tx_bytes"] - a[h]["tx_bytes"]) / steps for h in among)
    into = max((b[h]["rx_bytes"] - a[h]["rx_bytes"]) / steps for h in among)
    return out, into


def one_raysinga(made, job: str, topo: str, args, run: str) -> dict[str, float]:
    import hosts  # noqa: PLC0415

    head, n = made[0], args.hosts
    sets = [f"run_dir={SHARED}/runs/{run}", f"train_steps={args.warmup + args.steps}"]
    sets += SIDE_SETS.get(topo, [f"topology.preset={topo}"])
    sets += [f"topology.workers_per_group={n}", f"topology.worker.cpus={args.host_cpus}"]
    sets += [f"topology.n_servers={args.servers if topo == 'sandblaster' else n}"]
    address = f"{head.address}:6379"
    r = hosts.drive(made, raysinga_run, address, job, sets, args.warmup, args.steps, timeout=1800)
    lines = [x for x in r.stdout.splitlines() if x.startswith(RESULT)]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"raysinga {topo}: exit {r.returncode}\n{r.stdout[-4000:]}")
    marks = json.loads(lines[-1][len(RESULT) :])
    a, b = marks[str(args.warmup)], marks[str(args.warmup + args.steps)]
    from bench_distributed import BATCH  # noqa: PLC0415

    workers = {h.address for h in made[1:]}
    out, into = busiest(a["counters"], b["counters"], args.steps, workers)
    counted = b["net"] or {}
    most = max((max(v["in"], v["out"]) for h, v in counted.items() if h in workers), default=0.0)
    phases = marks["ms"]  # each report's mean step, by phase: their mean (equal windows)
    return {
        "samples_per_s": args.steps * BATCH / (b["t"] - a["t"]),
        "out": out,
        "in": into,
        "counted": float(most),
        "ms": {k: round(statistics.mean(p[k] for p in phases), 1) for k in phases[0]},
    }


def one_ddp(made, xp: str, yp: str, bf16: bool, args, run: str) -> dict[str, float]:
    import hosts  # noqa: PLC0415

    head = made[0]
    out_file = f"{SHARED}/runs/{run}.sps"
    cfg = {"x": xp, "y": yp, "steps": args.steps, "warmup": args.warmup, "out": out_file}
    cfg["bf16"] = bf16
    before = {h.address: h.counters() for h in made}
    address = f"{head.address}:6379"
    r = hosts.drive(made, ddp_run, address, cfg, args.hosts, args.host_cpus, timeout=1800)
    after = {h.address: h.counters() for h in made}
    if r.returncode != 0 or not head.path(out_file).exists():
        raise RuntimeError(f"DDP (bf16 {bf16}): exit {r.returncode}\n{r.stdout[-4000:]}")
    total = args.warmup + args.steps
    out, into = busiest(before, after, total, {h.address for h in made[1:]})
    sps = float(head.path(out_file).read_text())
    return {"samples_per_s": sps, "out": out, "in": into}


def main(args) -> None:
    import hosts  # noqa: PLC0415
    from bench_distributed import BATCH  # noqa: PLC0415

    why = hosts.unavailable()
    if why:
        raise SystemExit(f"bench_distributed.py --hosts: {why}")
    if args.hosts < 2:
        raise SystemExit("--hosts: at least 2 (the workers are spread one per host)")
    if BATCH % args.hosts:
        raise SystemExit(f"--hosts: must divide the global batch of {BATCH}")
    if args.warmup % DISP or args.steps % DISP:
        raise SystemExit(f"--warmup and --steps: multiples of {DISP} (a report at each end)")
    rates = [float(r) for r in args.link.split(",")]
    topos = args.topologies.split(",")
    bad = [t for t in topos if t not in TOPOLOGIES]
    if bad:
        raise SystemExit(f"--topologies: {', '.join(bad)} not among {', '.join(TOPOLOGIES)}")
    sides = [*topos, "ddp", "ddp-bf16"]
    runs: dict[tuple[float, str], list[dict[str, float]]] = {}
    root = Path(tempfile.mkdtemp(prefix="bench-distributed-hosts-"))
    try:
        measure(root, args, rates, sides, runs)
    finally:  # the hosts' files (their mounts and processes went with the lab)
        shutil.rmtree(root, ignore_errors=True)
    write_report(runs, args, rates, sides)


def measure(root: Path, args, rates: list[float], sides: list[str], runs: dict) -> None:
    """Every round of every side at every rate on a lab of emulated hosts under ``root``."""
    import hosts  # noqa: PLC0415
    from bench_distributed import make_data  # noqa: PLC0415

    with hosts.lab(root) as lab:
        made = hosts.ray_cluster(lab, [0] + [args.host_cpus] * args.hosts)
        shared = made[0].path(SHARED)
        (shared / "runs").mkdir(parents=True, exist_ok=True)
        xp, yp = make_data(shared, args.samples)  # the head's view of the shared directory
        xp, yp = f"{SHARED}/{Path(xp).name}", f"{SHARED}/{Path(yp).name}"
        job = f"{SHARED}/job.yaml"
        made[0].path(job).write_text(job_yaml(xp, yp))
        for rate in rates:
            for h in made:
                h.shape(rate)
            for r in range(args.rounds):
                for side in sides:
                    run = f"{side}-{rate:g}-{r}"
                    if side.startswith("ddp"):
                        fig = one_ddp(made, xp, yp, side == "ddp-bf16", args, run)
                    else:
                        fig = one_raysinga(made, job, side, args, run)
                    runs.setdefault((rate, side), []).append(fig)
                    print(f"  {rate:g} Mbit/s, {side}, round {r}: {fig}", flush=True)


def write_report(runs, args, rates: list[float], sides: list[str]) -> None:
    from bench_distributed import BATCH, DIM, HIDDEN  # noqa: PLC0415

    n = args.hosts
    p_bytes = 4 * (DIM * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10)
    ring = 2 * (n - 1) / n * p_bytes
    print(
        f"MLP 784-1024-1024-10 (P = {p_bytes / 1e6:.2f} MB), global batch {BATCH}, {n} hosts "
        f"of {args.host_cpus} CPU(s), one worker on each; {args.steps} timed steps after "
        f"{args.warmup}; {args.rounds} rounds; ring allreduce moves {ring / 1e6:.2f} MB per "
        "host per step each way"
    )
    report = Report("bench_distributed_hosts", {**vars(args), "ring_bytes": ring})
    names = {
        "sandblaster": f"raysinga sandblaster ({args.servers} server(s))",
        "allreduce": "raysinga allreduce (a server beside each worker)",
        "hosts": "raysinga allreduce summed by hosts",
        "hosts-bf16": "raysinga allreduce summed by hosts, bf16 on the wire",
        "hosts-zstd": "raysinga allreduce summed by hosts, float32 compressed (zstd)",
        "hosts-bf16-zstd": "raysinga allreduce summed by hosts, bf16 compressed (zstd)",
        "hosts-delta": "raysinga allreduce summed by hosts, float32, values' differences "
        "compressed",
        "hosts-bf16-delta": "raysinga allreduce summed by hosts, bf16, values' differences "
        "compressed",
        "ddp": "Ray Train DDP (gloo)",
        "ddp-bf16": "Ray Train DDP (gloo, bf16 hook)",
    }
    for rate in rates:
        sps = {s: [r["samples_per_s"] for r in runs[(rate, s)]] for s in sides}
        for s in sides:
            label = f"{rate:g} Mbit/s, {names[s]}"
            report.add(Figure(f"{label}: samples/s", sps[s], better="higher"), ",.0f")
            for way in ("out", "in"):
                vals = [r[way] / 1e6 for r in runs[(rate, s)]]
                report.add(Figure(f"{label}: busiest host, MB {way} per step", vals), ".2f")
        ours = [s for s in sides if not s.startswith("ddp")]
        exact = [s for s in ours if s not in BF16]  # float32's every bit on the wire
        if exact:
            best = max(exact, key=lambda s: statistics.median(sps[s]))
            ratio = [a / b for a, b in zip(sps[best], sps["ddp"], strict=True)]
            report.add(
                Figure(
                    f"{rate:g} Mbit/s: best float32 raysinga ({best}) / DDP samples/s",
                    ratio,
                    "x",
                    GOAL_VS_DDP,
                    "higher",
                )
            )
        if ours:
            for s in ours:
                vals = [max(r["out"], r["in"]) / ring for r in runs[(rate, s)]]
                goal = GOAL_RING if s == "hosts" else None
                name = f"{rate:g} Mbit/s, {names[s]}: busiest host / ring"
                report.add(Figure(name, vals, "x", goal))
        if "hosts" in sides and "hosts-bf16" in sides:
            most = lambda r: max(r["out"], r["in"])  # noqa: E731
            pairs = zip(runs[(rate, "hosts-bf16")], runs[(rate, "hosts")], strict=True)
            vals = [most(a) / most(b) for a, b in pairs]
            name = f"{rate:g} Mbit/s: bf16 / float32 bytes, busiest host (summed by hosts)"
            lo, hi = GOAL_BF16_BYTES
            report.add(Figure(name, vals, "x", hi))
            report.add(Figure(name + ", floor", vals, "x", lo, "higher"))
        halves = [s for s in BF16 if s in sides]
        if halves and rate == min(rates):
            best = max(halves, key=lambda s: statistics.median(sps[s]))
            for peer, goal in (("ddp", GOAL_BF16_VS_DDP), ("ddp-bf16", GOAL_VS_DDP)):
                ratio = [a / b for a, b in zip(sps[best], sps[peer], strict=True)]
                name = f"{rate:g} Mbit/s: best bf16 raysinga ({best}) / {names[peer]} samples/s"
                report.add(Figure(name, ratio, "x", goal, "higher"))
    report.write(args.json)
