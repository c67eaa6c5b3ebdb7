"""Checkpoint save and load of 1 GiB against a raw write/read, torch and safetensors, in one run.

Every contender stores the same tensors (a transformer-like mix of float32 matrices and small
vectors, 1 GiB in all) and every save ends with the bytes on the device (fsync)::

    pip install -e '.[bench]'
    python benchmarks/bench_checkpoint.py [--gib 1] [--rounds 5] [--dir DIR] [--verbose]

- raw: the tensors' bytes written back to back into one file, then fsync; read back with
  ``readinto`` into one buffer allocated and faulted in beforehand (the best case for raw).
- raysinga: ``checkpoint.save`` (Arrow shard, per-tensor and per-file xxh3, manifest, fsync of
  files and directory, atomic rename); load is ``Checkpoint.open(verify="full")``, which reads
  and hashes every byte, plus ``arrays()``.
- torch: ``torch.save`` of the tensors (then fsync) and ``torch.load(weights_only=True)``.
- safetensors: ``safetensors.numpy.save_file`` (then fsync) and ``load_file``.

Loads are timed from a cold page cache (the files are evicted with posix_fadvise after their
fsync) and again warm. One untimed round warms everything up first, and before every timed step
the device is left to finish earlier work (sync, a short pause). Then a 1 GiB checkpoint goes
into Ray's object store and another task on this node gets it. Prints medians over the rounds
and the ratios the goals are stated in.

The raw write is the plain loop (``write`` then ``fsync``); raysinga's writer also asks the
kernel to start write-back as it goes (``sync_file_range``), which is why it can beat raw.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def model_tensors(total: int) -> dict[str, np.ndarray]:
    """Blocks of a 1024-wide transformer (qkv, projection, two MLP matrices, norms, biases) and
    an embedding that brings the total to exactly ``total`` bytes."""
    rng = np.random.default_rng(0)
    shapes: dict[str, tuple[int, ...]] = {}
    d, block = 1024, 0
    per_block = 4 * (d * 3 * d + 3 * d + d * d + d + 2 * d * 4 * d + 4 * d + d + 4 * d)
    while (block + 1) * per_block < total // 2:
        p = f"block{block}"
        shapes |= {
            f"{p}/attn/qkv/W": (d, 3 * d),
            f"{p}/attn/qkv/b": (3 * d,),
            f"{p}/attn/proj/W": (d, d),
            f"{p}/attn/proj/b": (d,),
            f"{p}/mlp/fc1/W": (d, 4 * d),
            f"{p}/mlp/fc1/b": (4 * d,),
            f"{p}/mlp/fc2/W": (4 * d, d),
            f"{p}/mlp/fc2/b": (d,),
            f"{p}/norm/gamma": (d,),
            f"{p}/norm/beta": (d,),
        }
        block += 1
    used = sum(4 * int(np.prod(s)) for s in shapes.values())
    rest = (total - used) // 4
    shapes["embed/W"] = (rest // d, d)
    if rest % d:
        shapes["embed/extra"] = (rest % d,)
    return {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Drop ``path`` (a file or every file under a directory) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- contenders: save(tensors, dest) and load(dest) -> something holding every byte -------------

CHUNK = 16 << 20


def raw_save(tensors, dest: Path) -> None:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in tensors.values():
            mv = memoryview(a.reshape(-1).view(np.uint8))
            for i in range(0, len(mv), CHUNK):
                os.write(fd, mv[i : i + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


RAW_BUFFER: list[np.ndarray] = []  # allocated and faulted in before timing: raw's best case


def raw_load(dest: Path):
    n = dest.stat().st_size
    buf = RAW_BUFFER[0][:n]
    mv, got = memoryview(buf), 0
    with open(dest, "rb", buffering=0) as f:
        while got < n:
            got += f.readinto(mv[got : got + CHUNK])
    return buf


def ours_save(tensors, dest: Path) -> None:
    from raysinga import checkpoint

    checkpoint.save(dest, 1, tensors)


def ours_load(dest: Path):
    from raysinga.checkpoint import Checkpoint

    return Checkpoint.open(dest / "step-1", verify="full").arrays()


def torch_save(tensors, dest: Path) -> None:
    import torch

    torch.save({n: torch.from_numpy(a) for n, a in tensors.items()}, dest)
    fsync_file(dest)


def torch_load(dest: Path):
    import torch

    return torch.load(dest, weights_only=True)


def st_save(tensors, dest: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(dest))
    fsync_file(dest)


def st_load(dest: Path):
    from safetensors.numpy import load_file

    return load_file(str(dest))


CONTENDERS = {
    "raw": (raw_save, raw_load),
    "raysinga": (ours_save, ours_load),
    "torch": (torch_save, torch_load),
    "safetensors": (st_save, st_load),
}


def settle() -> None:
    """Let the device finish what the previous contender left (deleted files, write-back), so
    that no one is charged for another's work."""
    os.sync()
    time.sleep(0.5)


def timed(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def disk_round(tensors, work: Path, order: list[str], times: dict) -> None:
    for name in order:
        save, load = CONTENDERS[name]
        dest = work / name
        settle()
        t, _ = timed(save, tensors, dest)
        times[name]["save"].append(t)
        evict(dest)
        settle()
        t, out = timed(load, dest)
        times[name]["load cold"].append(t)
        del out
        t, out = timed(load, dest)
        times[name]["load warm"].append(t)
        del out
        if dest.is_dir():
            shutil.rmtree(dest)
        else:
            dest.unlink()


def _get_in_task(refs, verify: str) -> float:
    from raysinga.checkpoint import objstore

    t = time.perf_counter()
    ck = objstore.get(refs[0], verify=verify)
    arrays = ck.arrays()
    elapsed = time.perf_counter() - t
    assert sum(a.nbytes for a in arrays.values()) > 0
    return elapsed


def object_store(tensors, work: Path, rounds: int) -> dict[str, list[float]]:
    import ray

    from raysinga import checkpoint
    from raysinga.checkpoint import objstore

    path = checkpoint.save(work / "objstore-run", 1, tensors)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ref = objstore.put(path)
        task = ray.remote(num_cpus=1)(_get_in_task)
        ray.get(task.remote([ref], "fast"))  # start the worker process; not timed
        out: dict[str, list[float]] = {"fast": [], "full": [], "round trip": []}
        for _ in range(rounds):
            out["fast"].append(ray.get(task.remote([ref], "fast")))
            out["full"].append(ray.get(task.remote([ref], "full")))
            t = time.perf_counter()
            ray.get(task.remote([ref], "fast"))
            out["round trip"].append(time.perf_counter() - t)
        return out
    finally:
        ray.shutdown()


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, typ, *_ = line.split()
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, f"{typ} on {dev}"
    return kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    ap.add_argument("--verbose", action="store_true", help="print every round's times")
    ap.add_argument("--no-objstore", action="store_true", help="skip the object-store part")
    args = ap.parse_args()

    tensors = model_tensors(int(args.gib * (1 << 30)))
    nbytes = sum(a.nbytes for a in tensors.values())
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)).resolve()
    print(
        f"{nbytes / (1 << 30):.2f} GiB in {len(tensors)} float32 tensors; writing under {work} "
        f"({fs_type(work)}); {args.rounds} rounds, medians"
    )
    RAW_BUFFER.append(np.ones(nbytes, np.uint8))
    times = {n: {"save": [], "load cold": [], "load warm": []} for n in CONTENDERS}
    try:
        names = list(CONTENDERS)
        disk_round(tensors, work, names, {n: {k: [] for k in d} for n, d in times.items()})
        for r in range(args.rounds):  # a different order each round: no one always goes first
            disk_round(tensors, work, names[r % len(names) :] + names[: r % len(names)], times)
        med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in times.items()}
        gb = nbytes / 1e9
        print(f"\n{'':12}" + "".join(f"{k:>22}" for k in ("save", "load cold", "load warm")))
        for n, d in med.items():
            print(f"{n:12}" + "".join(f"{d[k]:8.3f} s {gb / d[k]:7.2f} GB/s" for k in d))
        print("\nraysinga speed relative to each (>1: raysinga is faster)")
        for peer in ("raw", "torch", "safetensors"):
            print(
                f"  vs {peer:12}"
                + "".join(f"  {k} {med[peer][k] / med['raysinga'][k]:5.2f}x" for k in med[peer])
            )
        if args.verbose:
            print("\nevery round (s):")
            for n, d in times.items():
                print(
                    f"  {n:12}"
                    + "  ".join(f"{k} " + " ".join(f"{x:.3f}" for x in v) for k, v in d.items())
                )
        print("goals: save >= 0.90x raw, load (every byte read and hashed) >= 0.90x raw;")
        print("       both > 1x torch and safetensors")
        if not args.no_objstore:
            got = object_store(tensors, work, args.rounds)
            print(f"\nobject store, {nbytes / (1 << 30):.2f} GiB, another task on this node:")
            print(f"  get, size checks only:      max {max(got['fast']):.4f} s  (goal < 0.2 s)")
            print(f"  get, every byte hashed:     max {max(got['full']):.4f} s")
            print(f"  driver round trip of a get: max {max(got['round trip']):.4f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
