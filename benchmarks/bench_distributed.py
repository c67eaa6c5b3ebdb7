"""raysinga on Ray against Ray Train's TorchTrainer (DDP over gloo), in one run.

Same MLP (784-1024-1024-10, float32), same data (a fixed synthetic teacher set in a .npy file),
same global batch (256, 128 per worker), SGD with momentum, two workers with one CPU each::

    pip install -e '.[bench,examples]'
    python benchmarks/bench_distributed.py [--steps 60] [--warmup 60]

Prints samples/s of each, their ratios, the single-process reference, and raysinga's per-step
breakdown (fetch parameters, compute, gather, average, update) with the framework overhead:
step time minus the workers' compute. ``--rounds N`` (3) runs the three side by side N times:
each figure is the median of its rounds, with their minimum and maximum. Goals: raysinga at
0.85x or more of the single process, a framework overhead of at most 3 ms per step.
``--json FILE`` writes every figure and round. ``--no-peer`` leaves Ray Train out (raysinga
against its single process only, as CI's guard runs it: ``benchmarks/ci_guard.py``);
``--wire bf16`` sums raysinga's group by hosts (``reduce: hosts``) with gradients and values
crossing as bfloat16. raysinga runs with its default fault settings
and a display (which ends a chunk of steps) every 20 steps: its idle spare worker and stub
(``fault.spares``) start after the first chunk and have loaded before the timed steps (a
one-time cost at a run's start, as the start of Ray Train's workers is, which its timing
leaves out too).

``--spares-rounds N`` instead times raysinga alone with spares off and on, alternating, N
rounds each, once the spares have loaded (chunks of 10 steps, the warm-up's dropped): the cost
of keeping them (goal: at most 3% of step time). ``--replay-rounds N`` does the same for the
servers' copies and the stub's replay log, which a lost server is rebuilt from
(``fault.replay_steps`` 0 against its default; goal: at most 3% of step time)::

    python benchmarks/bench_distributed.py --spares-rounds 3 --warmup 80 --steps 100
    python benchmarks/bench_distributed.py --replay-rounds 3 --warmup 80 --steps 100

``--hosts N --link RATE[,RATE...]`` runs raysinga's topologies and DDP (float32, and with its
bf16 compression hook) on a head and N emulated hosts whose links are shaped to each RATE
(Mbit/s), with the bytes per step of the busiest host beside ring allreduce's
(``benchmarks/distributed_hosts.py``; root)::

    python benchmarks/bench_distributed.py --hosts 4 --link 1000,200 --rounds 3

``--device gpu`` compares one group of two GPU workers and a GPU server, sharing one GPU, with
the single-process GPU run of the same job, both with CUDA graphs (``gpu.graphs``); goal: at
least 0.85x the single process's samples/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from report import Figure, Report, add_json_option, quiet

BATCH, HIDDEN, CLASSES, DIM = 256, 1024, 10, 784
GOAL_VS_LOCAL = 0.85  # raysinga's samples/s against the single process, at least
GOAL_OVERHEAD_MS = 3.0  # step time minus the workers' compute, at most
GOAL_COST = 1.03  # step time with spares or the replay log against without, at most
GOAL_OBSERVE = 1.02  # step time with Ray metrics and MLflow against without, at most
MODEL = {
    "input_shape": [DIM],
    "layers": [
        {"kind": "dense", "name": "fc1", "units": HIDDEN, "activation": "relu"},
        {"kind": "dense", "name": "fc2", "units": HIDDEN, "activation": "relu"},
        {"kind": "dense", "name": "out", "units": CLASSES},
    ],
}


def make_data(d: Path, n: int) -> tuple[str, str]:
    from raysinga.data import TeacherDataset

    x, y = TeacherDataset(n, DIM, CLASSES, seed=1).get(np.arange(n))
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", y)
    return str(d / "x.npy"), str(d / "y.npy")


def job(
    xp: str,
    yp: str,
    steps: int,
    warmup: int,
    topology: dict | None,
    fault: dict | None = None,
    disp: int | None = None,
    gpu: bool = False,
    more: dict | None = None,
):
    from raysinga import config

    on_gpu = {"device": "gpu", "gpu": {"graphs": True}} if gpu else {}
    return config.from_dict(
        {
            **on_gpu,
            **(more or {}),
            "fault": fault or {},
            "name": "bench",
            "seed": 0,
            "model": MODEL,
            "run_dir": tempfile.mkdtemp(),
            "data": {"source": {"kind": "npy", "x": xp, "y": yp}, "batch_size": BATCH},
            "updater": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "train_steps": warmup + steps,
            "disp_freq": disp or warmup,
            "test_freq": 0,
            "topology": topology,
        }
    )


# The GPU comparison's topology: two GPU workers and a GPU server sharing one device.
GPU_TOPOLOGY = {
    "workers_per_group": 2,
    "n_servers": 1,
    "worker": {"cpus": 1, "gpus": 0.25},
    "server": {"cpus": 0, "gpus": 0.25},
}


def bench_raysinga(
    xp,
    yp,
    steps,
    warmup,
    fault: dict | None = None,
    disp: int | None = None,
    gpu: bool = False,
    more: dict | None = None,
    topology: dict | None = None,
):
    from raysinga.distributed import DistributedTrainer

    quiet()  # nothing left of the contender before (its processes exiting) is charged here
    topo = GPU_TOPOLOGY if gpu else {"workers_per_group": 2, "n_servers": 1, **(topology or {})}
    cfg = job(xp, yp, steps, warmup, topo, fault, disp or 20, gpu, more)
    t = DistributedTrainer(cfg, log=lambda s: None)
    res = t.fit()
    # the warm-up's windows dropped (chunks end at display steps: with a short ``disp``, the
    # spares, spawned after the first chunk, have loaded before the timed steps)
    timed = [r for r in res.history if r["kind"] == "train" and r["step"] > warmup]
    sps = np.mean([r["samples_per_s"] for r in timed])
    ms = {k: np.mean([r["ms"][k] for r in timed]) for k in timed[0]["ms"]}
    return {"samples_per_s": sps, "ms": ms}


def bench_local(xp, yp, steps, warmup, gpu: bool = False) -> dict:
    from raysinga.run import Trainer

    quiet()
    cfg = job(xp, yp, steps, warmup, None, disp=20 if gpu else None, gpu=gpu)
    res = Trainer(cfg, log=lambda s: None).fit()
    timed = [r for r in res.history if r["kind"] == "train" and r["step"] > warmup]
    return {"samples_per_s": np.mean([r["samples_per_s"] for r in timed])}


def torch_loop(cfg: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    x = torch.from_numpy(np.load(cfg["x"], mmap_mode="r")[:])
    y = torch.from_numpy(np.load(cfg["y"], mmap_mode="r")[:])
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    model = ray.train.torch.prepare_model(model)
    if cfg.get("bf16"):  # the gradients cross as bfloat16 (the hosts' benchmark's second peer)
        model.register_comm_hook(None, bf16_hook_for_gloo)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    per = BATCH // world
    steps_per_epoch = len(x) // BATCH
    t0 = None
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            t0 = time.perf_counter()
        b = step % steps_per_epoch
        idx = order[b * BATCH + rank * per : b * BATCH + (rank + 1) * per]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    dt = time.perf_counter() - t0
    if rank == 0:  # Train v2 keeps no metrics without a checkpoint: hand the figure back by file
        Path(cfg["out"]).write_text(str(cfg["steps"] * BATCH / dt))


def bf16_hook_for_gloo(group, bucket):
    """PyTorch's ``default_hooks.bf16_compress_hook`` (each bucket of gradients averaged as
    bfloat16, rounded to nearest even, then written back as float32) under another name:
    DDP refuses a hook of that name without CUDA and NCCL, while gloo reduces bfloat16 tensors
    on the CPU."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    world = dist.get_world_size(group)
    half = buf.to(dtype=torch.bfloat16).div_(world)
    fut = dist.all_reduce(half, group=group, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


def bench_ray_train(xp, yp, steps, warmup) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    quiet()
    out = Path(tempfile.mkdtemp()) / "samples_per_s"
    trainer = TorchTrainer(
        torch_loop,
        train_loop_config={"x": xp, "y": yp, "steps": steps, "warmup": warmup, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(), name="bench"),
    )
    trainer.fit()
    return {"samples_per_s": float(out.read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--samples", type=int, default=16384)
    ap.add_argument(
        "--spares-rounds",
        type=int,
        default=0,
        help="instead: raysinga with fault.spares off and on, alternating, this many rounds each "
        "(warm-up long enough for the spares to have loaded before the timed steps)",
    )
    ap.add_argument(
        "--replay-rounds",
        type=int,
        default=0,
        help="instead: raysinga with the servers' copies and the replay log off and on, "
        "alternating, this many rounds each",
    )
    ap.add_argument(
        "--observe-rounds",
        type=int,
        default=0,
        help="instead: raysinga with its metrics through Ray's agent and MLflow off and on, "
        "alternating, this many rounds each (the status file is written either way)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three runs")
    ap.add_argument(
        "--no-peer",
        action="store_true",
        help="leave Ray Train out: raysinga against its single process only (CI's guard)",
    )
    ap.add_argument(
        "--wire",
        default=None,
        help="raysinga's group summed by hosts (`reduce: hosts`, one worker a block) with this "
        "`topology.wire` (bf16: gradients and values cross as bfloat16)",
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: one group of two GPU workers and a GPU server sharing one GPU against the "
        "single-process GPU run of the job, both with CUDA graphs (no Ray Train)",
    )
    ap.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="N: on a head and N emulated hosts, one worker on each, against DDP on the same "
        "hosts (root; benchmarks/distributed_hosts.py)",
    )
    ap.add_argument("--link", default="1000,200", help="with --hosts: link rates, Mbit/s")
    ap.add_argument("--host-cpus", type=int, default=1, help="with --hosts: CPUs of each host")
    ap.add_argument(
        "--topologies",
        default="sandblaster,allreduce,hosts,hosts-bf16",
        help="with --hosts: raysinga's",
    )
    ap.add_argument("--servers", type=int, default=1, help="with --hosts: sandblaster's servers")
    add_json_option(ap)
    args = ap.parse_args()
    if args.hosts:
        import distributed_hosts

        distributed_hosts.main(args)
        return
    import ray

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as d:
        xp, yp = make_data(Path(d), args.samples)
        a = (xp, yp, args.steps, args.warmup)
        report = Report("bench_distributed", vars(args))
        if args.spares_rounds:
            off, on = {"spares": False}, {"spares": True}
            cost(*a, args.spares_rounds, "spares", off, on, report)
            report.write(args.json)
            return
        if args.replay_rounds:
            off, on = {"replay_steps": 0}, {"replay_steps": 20}
            what = "the servers' copies and the replay log"
            cost(*a, args.replay_rounds, what, off, on, report)
            report.write(args.json)
            return
        if args.observe_rounds:
            # metrics through Ray's agent, MLflow (a local store) and the status file, against
            # none of them ([O]; docs/observe.md)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            store = f"file://{tempfile.mkdtemp()}/mlruns"
            off = {"metrics": {"ray": False}}
            on = {"metrics": {"ray": True}, "mlflow": {"tracking_uri": store}}
            what = "Ray metrics and MLflow"
            cost(*a, args.observe_rounds, what, off, on, report, "job", GOAL_OBSERVE)
            report.write(args.json)
            return
        if args.device == "gpu":
            on_gpu(a, args.rounds, report)
            report.write(args.json)
            return
        runs: dict[str, list[dict]] = {"ours": [], "peer": [], "local": []}
        if args.no_peer:
            del runs["peer"]
        topology = {"reduce": "hosts", "wire": args.wire} if args.wire else None
        for _ in range(args.rounds):  # the three side by side in each round
            runs["ours"].append(bench_raysinga(*a, topology=topology))
            if not args.no_peer:
                runs["peer"].append(bench_ray_train(*a))
            runs["local"].append(bench_local(*a))
    print(
        f"MLP 784-1024-1024-10, global batch {BATCH}, 2 workers x 1 CPU, {args.steps} timed "
        f"steps after {args.warmup} warm-up, {args.rounds} rounds, {os.cpu_count()} cores"
    )
    sps = {k: [r["samples_per_s"] for r in v] for k, v in runs.items()}
    wire = f", reduce: hosts, wire: {args.wire}" if args.wire else ""
    for key, label in (
        ("ours", f"raysinga (1 group x 2 workers x 1 server{wire})"),
        ("peer", "Ray Train TorchTrainer (DDP, gloo)"),
        ("local", "raysinga single process (no Ray)"),
    ):
        if key in sps:
            report.add(Figure(f"{label}, samples/s", sps[key], better="higher"), ",.0f")

    def per_round(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(sps[a], sps[b], strict=True)]

    if "peer" in sps:
        vs_peer = per_round("ours", "peer")
        report.add(Figure("ratio raysinga / Ray Train", vs_peer, "x", better="higher"))
    report.add(
        Figure(
            "ratio raysinga / single process",
            per_round("ours", "local"),
            "x",
            GOAL_VS_LOCAL,
            "higher",
        )
    )
    ms = [r["ms"] for r in runs["ours"]]
    overhead = [m["total"] - m["compute"] for m in ms]
    report.add(
        Figure("framework overhead per step (step - compute)", overhead, " ms", GOAL_OVERHEAD_MS),
        ".2f",
    )
    print(
        "  raysinga per step, median ms: "
        + ", ".join(f"{k} {statistics.median(m[k] for m in ms):.2f}" for k in ms[0])
    )
    report.write(args.json)


def on_gpu(a: tuple, rounds: int, report: Report) -> None:
    """The distributed run on one shared GPU against the single-process GPU run, round by
    round. Goal: at least 0.85x the single process's samples/s."""
    ours, local = [], []
    for _ in range(rounds):
        ours.append(bench_raysinga(*a, gpu=True)["samples_per_s"])
        local.append(bench_local(*a, gpu=True)["samples_per_s"])
    print(
        f"MLP 784-1024-1024-10, global batch {BATCH}, on one GPU with CUDA graphs: 1 group x 2 "
        f"GPU workers (0.25 GPU each) and a GPU server (0.25), against one process"
    )
    report.add(Figure("gpu: raysinga 1x2 workers + server, samples/s", ours, better="higher"))
    report.add(Figure("gpu: raysinga single process, samples/s", local, better="higher"))
    ratio = [x / y for x, y in zip(ours, local, strict=True)]
    report.add(
        Figure("gpu: ratio distributed / single process", ratio, "x", GOAL_VS_LOCAL, "higher")
    )


def cost(
    xp: str,
    yp: str,
    steps: int,
    warmup: int,
    rounds: int,
    what: str,
    off,
    on,
    report: Report,
    key: str = "fault",
    goal: float = GOAL_COST,
) -> None:
    """Step time with a feature on (the job's ``key`` settings ``on``: ``fault``'s, or the
    job's own keys) against off (``off``), alternating, once what it spawns has loaded: what
    keeping it costs training. Goal: at most 3% (fault tolerance), or ``goal``."""
    totals: dict[bool, list[float]] = {False: [], True: []}
    phases: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for k, sets in ((False, off), (True, on)):
            fault, more = (sets, None) if key == "fault" else (None, sets)
            run = bench_raysinga(xp, yp, steps, warmup, fault, disp=10, more=more)
            totals[k].append(run["ms"]["total"])
            phases[k].append(run["ms"])
    print(
        f"MLP 784-1024-1024-10, 1 group x 2 workers x 1 server, {steps} timed steps after "
        f"{warmup} warm-up, {rounds} rounds, {os.cpu_count()} cores; {key} {off} against {on}"
    )
    for label, k in (("off", False), ("on", True)):
        report.add(Figure(f"step time, {what} {label}", totals[k], " ms"), ".2f")
    ratios = [b / a for a, b in zip(totals[False], totals[True], strict=True)]
    report.add(Figure(f"step-time ratio, {what} on / off, per round", ratios, goal=goal))
    # the workers' compute dominates the spread; the phases around it show where a cost lands
    print(
        "  per step, median ms off -> on: "
        + ", ".join(
            f"{p} {statistics.median(r[p] for r in phases[False]):.2f} -> "
            f"{statistics.median(r[p] for r in phases[True]):.2f}"
            for p in ("compute", "average", "update", "server")
        )
    )


if __name__ == "__main__":
    main()
