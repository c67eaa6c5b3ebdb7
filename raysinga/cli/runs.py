"""``raysinga runs``: the runs under a directory (their checkpoints, newest step and size) and
the entries of a cluster's object-store checkpoint registry, which it can also drop; and
``raysinga status``: what a run's driver last wrote of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raysinga.checkpoint.format import STEP_DIR
from raysinga.checkpoint.manage import latest, steps
from raysinga.run.record import RESOLVED_JOB


def local_runs(where: Path) -> list[dict[str, Any]]:
    """Each run under ``where`` (a directory of run directories, as ``runs/``, or one run
    directory): its checkpoints, the newest valid one (sizes checked), their bytes."""
    candidates = [where] if (where / "checkpoints").is_dir() else sorted(where.iterdir())
    out = []
    for run in candidates:
        ck_dir = run / "checkpoints"
        if not ck_dir.is_dir():
            continue
        have = steps(str(ck_dir))
        newest = latest(str(ck_dir), verify="fast").checkpoint if have else None
        size = sum(
            f.stat().st_size
            for d in ck_dir.iterdir()
            if d.is_dir() and STEP_DIR.match(d.name)
            for f in d.iterdir()
            if f.is_file()
        )
        aside = [d.name for d in ck_dir.iterdir() if d.is_dir() and "." in d.name]
        out.append(
            {
                "run": run.name,
                "dir": str(run),
                "checkpoints": len(have),
                "newest_valid": None if newest is None else newest.step,
                "bytes": size,
                "set_aside": sorted(aside),
                "job": str(run / RESOLVED_JOB) if (run / RESOLVED_JOB).is_file() else None,
            }
        )
    return out


def registry_entries(run_key: str | None = None) -> list[dict[str, Any]]:
    """The cluster's object-store checkpoint registry (Ray must be connected): one entry per
    (run key, step), with its bytes, disk copy, and whether the object is still there."""
    import ray  # noqa: PLC0415

    from raysinga.run import registry as run_registry  # noqa: PLC0415

    reg = run_registry.actor()
    if reg is None:
        return []
    entries = ray.get(reg.list.remote(run_key))
    for e in entries:
        full = ray.get(reg.lookup.remote(e["run"], e["step"]))
        ready, _ = ray.wait(full["refs"], timeout=0, fetch_local=False) if full else ([], [])
        e["in_memory"] = bool(ready)
    return entries


def drop(run_key: str, step: int | None = None) -> list[int]:
    """Drop a run's registry entries (every step, or one): their objects are freed once no
    task holds them. Returns the steps dropped."""
    import ray  # noqa: PLC0415

    from raysinga.run import registry as run_registry  # noqa: PLC0415

    reg = run_registry.actor()
    if reg is None:
        return []
    have = [e["step"] for e in ray.get(reg.list.remote(run_key))]
    gone = [s for s in have if step is None or s == step]
    for s in gone:
        ray.get(reg.delete.remote(run_key, s))
    return gone


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """``rows`` as aligned text columns (key, heading); sizes in MiB."""

    def cell(r: dict[str, Any], k: str) -> str:
        v = r.get(k)
        if k in ("bytes", "nbytes"):
            return f"{(v or 0) / 2**20:.1f} MiB"
        if isinstance(v, list):
            return ", ".join(v) or "-"
        return "-" if v is None else str(v)

    body = [[cell(r, k) for k, _ in columns] for r in rows]
    widths = [max([len(h), *(len(b[i]) for b in body)]) for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) for (_, h), w in zip(columns, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(line.rstrip() for line in lines)


def listing(args: Any) -> int:
    """``raysinga runs``: the runs under ``args.dir`` (:func:`local_runs`), or with
    ``--registry`` the cluster's registry entries (:func:`registry_entries`), which ``--drop``
    removes."""
    import json  # noqa: PLC0415

    if not args.registry:
        if args.drop is not None or args.step is not None:
            raise ValueError("--drop and --step go with --registry")
        where = Path(args.dir)
        if not where.is_dir():
            raise ValueError(f"{where}: no such directory of runs")
        rows = local_runs(where)
        if not rows and not args.json:
            print(f"no runs with checkpoints under {where}")
            return 0
        cols = [("run", "run"), ("checkpoints", "checkpoints"), ("newest_valid", "newest valid")]
        cols += [("bytes", "size"), ("set_aside", "set aside")]
        print(json.dumps(rows, indent=2) if args.json else table(rows, cols))
        return 0
    if args.step is not None and args.drop is None:
        raise ValueError("--step goes with --drop")
    from raysinga.cluster.connect import connect, joins_cluster  # noqa: PLC0415

    if not joins_cluster(args.address):
        raise ValueError(
            "--registry: no Ray cluster to ask (give --address or RAY_ADDRESS, or run it where "
            "`ray start` runs); an embedded Ray has no registry"
        )
    connect(args.address)
    if args.drop is not None:
        gone = drop(args.drop, args.step)
        if not gone:
            raise ValueError(f"--drop {args.drop}: no such entry in the registry")
        print(f"dropped {args.drop} step(s) {', '.join(map(str, gone))}")
        return 0
    rows = registry_entries()
    if not rows and not args.json:
        print("the registry holds no checkpoints")
        return 0
    cols = [("run", "run key"), ("step", "step"), ("nbytes", "size"), ("in_memory", "in memory")]
    cols += [("uri", "disk copy")]
    print(json.dumps(rows, indent=2) if args.json else table(rows, cols))
    return 0


def status(args: Any) -> int:
    """``raysinga status RUN``: what the driver of a run on Ray last wrote of it
    (:mod:`raysinga.distributed.status`), from its run directory or its name (``runs/NAME``);
    with ``--address``, the run of that name on the cluster there, from any machine."""
    import json  # noqa: PLC0415

    from raysinga.distributed import status as run_status  # noqa: PLC0415

    if args.address:
        st = run_status.read_live(args.run, args.address)
    else:
        st = run_status.read(run_dir(args.run, run_status.FILE))
    if args.json:
        print(json.dumps({**st, "driver": run_status.driver(st)}, indent=2))
    else:
        print(run_status.render(st))
    return 0


def run_dir(run: str, status_file: str) -> Path:
    """The run directory ``raysinga status RUN`` reads: ``RUN`` itself or, for a bare name,
    ``runs/RUN`` (where a run without ``run_dir`` writes); the first of them that holds
    ``status_file``, else the first that is a directory. ValueError naming each place looked
    at where none is."""
    tried = [Path(run)] + ([Path("runs", run)] if "/" not in run else [])
    for where in tried:
        if (where / status_file).is_file():
            return where
    for where in tried:
        if where.is_dir():
            return where
    if len(tried) == 1:
        raise ValueError(f"{run}: no such run directory")
    raise ValueError(
        f"{run}: no run of that name: neither {tried[0]}/ nor {tried[1]}/ is a directory in "
        f"{Path.cwd()} (a run's name stands for runs/NAME under the directory it was started "
        "from; or give its run directory)"
    )
