"""Checkpoint save and load of 1 GiB against a raw write/read, torch and safetensors, in one run.

Every contender stores the same tensors (a transformer-like mix of float32 matrices and small
vectors, 1 GiB in all) and every save ends with the bytes on the device (fsync)::

    pip install -e '.[bench]'
    python benchmarks/bench_checkpoint.py [--gib 1] [--rounds 5] [--dir DIR] [--verbose]

- raw: the tensors' bytes written back to back into one file, then fsync; read back with
  ``readinto`` into one buffer allocated and faulted in beforehand (the best case for raw).
  Four other plain writers of the same file are timed too, so that the goal is against the
  disk rather than against one loop: one large write of the tensors copied into one buffer,
  ``writev`` (every tensor in as few system calls as the kernel takes), four threads each
  writing its share of the file with ``pwrite``, and ``O_DIRECT`` through a page-aligned
  staging buffer (skipped where the file system refuses it). raysinga's save is compared with
  the fastest of the five in each round.
- raysinga: ``checkpoint.save`` (Arrow shard, per-tensor and per-file xxh3, manifest, fsync of
  files and directory, atomic rename); load is ``Checkpoint.open(verify="full")``, which reads
  and hashes every byte, plus ``arrays()``.
- torch: ``torch.save`` of the tensors (then fsync) and ``torch.load(weights_only=True)``.
- safetensors: ``safetensors.numpy.save_file`` (then fsync) and ``load_file``.

Loads are timed from a cold page cache (the files are evicted with posix_fadvise after their
fsync) and again warm. One untimed round warms everything up first, and before every timed step
the device is left to finish earlier work (sync, a short pause). Then a 1 GiB checkpoint goes
into Ray's object store and another task on this node gets it. Prints medians over the rounds,
and the per-round ratios the goals are stated in as medians with their minimum and maximum,
each goal met or not met (``--json FILE`` writes them all). Goals: save at least 0.9x the
fastest raw write and faster than torch and safetensors; a cold load, every byte read and
hashed, at least 0.9x the raw read and faster than both; the slowest object-store get under
0.2 s.

raysinga's writer also asks the kernel to start write-back as it goes (``sync_file_range``),
which is why it can beat the plain loop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from report import Figure, Report, add_json_option, fs_type


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


@contextlib.contextmanager
def _synced(dest: Path, flags: int = 0):
    """A new file's descriptor for a plain writer, fsync'd when the writer is done."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        yield fd
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_save(tensors, dest: Path) -> None:
    with _synced(dest) as fd:
        for a in tensors.values():
            mv = memoryview(a.reshape(-1).view(np.uint8))
            for i in range(0, len(mv), CHUNK):
                os.write(fd, mv[i : i + CHUNK])


def _views(tensors) -> list[memoryview]:
    return [memoryview(a.reshape(-1).view(np.uint8)) for a in tensors.values()]


def raw_writev_save(tensors, dest: Path) -> None:
    """Every tensor in as few system calls as the kernel takes (``writev``), then fsync."""
    with _synced(dest) as fd:
        pending = [v for v in _views(tensors) if len(v)]
        while pending:
            batch = pending[: os.sysconf("SC_IOV_MAX")]
            n = os.writev(fd, batch)
            while batch and n >= len(batch[0]):  # drop what was written, keep a partial tail
                n -= len(batch[0])
                batch.pop(0)
                pending.pop(0)
            if n:
                pending[0] = pending[0][n:]


def raw_one_write_save(tensors, dest: Path) -> None:
    """The tensors copied back to back into one buffer (allocated and faulted in beforehand),
    written with as few ``write`` calls as the kernel takes, then fsync: what a writer that
    first lays the whole file out in memory (as safetensors does) can do at best."""
    total = sum(a.nbytes for a in tensors.values())
    buf, off = STAGE_BUFFER[0][:total], 0
    for a in tensors.values():
        buf[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        off += a.nbytes
    with _synced(dest) as fd:
        mv, done = memoryview(buf), 0
        while done < total:
            done += os.write(fd, mv[done:])


def raw_parallel_save(tensors, dest: Path, threads: int = 4) -> None:
    """The file cut into ``threads`` byte ranges, each written by its own thread (``pwrite``
    releases the GIL), then fsync."""
    from concurrent.futures import ThreadPoolExecutor

    views = _views(tensors)
    total = sum(len(v) for v in views)
    flat: list[tuple[int, memoryview]] = []  # (file offset, piece) in CHUNK pieces
    off = 0
    for v in views:
        for i in range(0, len(v), CHUNK):
            flat.append((off + i, v[i : i + CHUNK]))
        off += len(v)
    with _synced(dest) as fd:
        os.ftruncate(fd, total)

        def run(k: int) -> None:
            for o, piece in flat[k::threads]:
                done = 0
                while done < len(piece):
                    done += os.pwrite(fd, piece[done:], o + done)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(threads)))


def raw_direct_save(tensors, dest: Path) -> None:
    """``O_DIRECT`` (past the page cache) through a page-aligned staging buffer of CHUNK bytes,
    the file trimmed to its length at the end; raises OSError where the file system refuses
    ``O_DIRECT`` (tmpfs)."""
    import mmap

    stage = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT wants
    try:
        _direct_write(tensors, dest, stage)
    finally:
        stage.close()


def _direct_write(tensors, dest: Path, stage) -> None:
    buf = np.frombuffer(stage, np.uint8)
    try:
        with _synced(dest, os.O_DIRECT) as fd:
            total, fill = 0, 0
            for v in _views(tensors):
                i = 0
                while i < len(v):
                    take = min(CHUNK - fill, len(v) - i)
                    buf[fill : fill + take] = np.frombuffer(v[i : i + take], np.uint8)
                    fill, i = fill + take, i + take
                    if fill == CHUNK:
                        os.write(fd, buf)
                        total, fill = total + CHUNK, 0
            if fill:  # whole 4 KiB blocks, zero padded, the file cut back to size
                padded = -(-fill // 4096) * 4096
                buf[fill:padded] = 0
                os.write(fd, buf[:padded])
                os.ftruncate(fd, total + fill)
    finally:
        del buf  # the staging buffer's export, before the caller closes it


RAW_BUFFER: list[np.ndarray] = []  # allocated and faulted in before timing: raw's best case
STAGE_BUFFER: list[np.ndarray] = []  # the same, for raw_one_write_save's copy


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


CONTENDERS = {  # name: (save, load or None: the file is raw's, its load timed once as "raw")
    "raw": (raw_save, raw_load),
    "raw one write": (raw_one_write_save, None),
    "raw writev": (raw_writev_save, None),
    "raw 4 threads": (raw_parallel_save, None),
    "raw O_DIRECT": (raw_direct_save, None),
    "raysinga": (ours_save, ours_load),
    "torch": (torch_save, torch_load),
    "safetensors": (st_save, st_load),
}
RAW = [n for n in CONTENDERS if n.startswith("raw")]


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
        try:
            t, _ = timed(save, tensors, dest)
        except OSError as e:  # O_DIRECT on a file system without it
            times[name].setdefault("refused", str(e))
            dest.unlink(missing_ok=True)
            continue
        times[name]["save"].append(t)
        if load is None:
            dest.unlink()
            continue
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    ap.add_argument("--verbose", action="store_true", help="print every round's times")
    ap.add_argument("--no-objstore", action="store_true", help="skip the object-store part")
    add_json_option(ap)
    args = ap.parse_args()

    tensors = model_tensors(int(args.gib * (1 << 30)))
    nbytes = sum(a.nbytes for a in tensors.values())
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)).resolve()
    print(
        f"{nbytes / (1 << 30):.2f} GiB in {len(tensors)} float32 tensors; writing under {work} "
        f"({fs_type(work)}); {args.rounds} rounds, medians"
    )
    RAW_BUFFER.append(np.ones(nbytes, np.uint8))
    STAGE_BUFFER.append(np.ones(nbytes, np.uint8))
    times = {n: {"save": [], "load cold": [], "load warm": []} for n in CONTENDERS}
    try:
        names = list(CONTENDERS)
        disk_round(tensors, work, names, {n: {k: [] for k in d} for n, d in times.items()})
        for r in range(args.rounds):  # a different order each round: no one always goes first
            disk_round(tensors, work, names[r % len(names) :] + names[: r % len(names)], times)
        for n, d in times.items():
            if "refused" in d:
                print(f"{n}: not measured ({d.pop('refused')})")
        measured = {n: {k: v for k, v in d.items() if v} for n, d in times.items()}
        measured = {n: d for n, d in measured.items() if d}
        med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in measured.items()}
        gb = nbytes / 1e9
        print(f"\n{'':14}" + "".join(f"{k:>22}" for k in ("save", "load cold", "load warm")))
        for n, d in med.items():
            print(f"{n:14}" + "".join(f"{d[k]:8.3f} s {gb / d[k]:7.2f} GB/s" for k in d))
        if args.verbose:
            print("\nevery round (s):")
            for n, d in measured.items():
                print(
                    f"  {n:14}"
                    + "  ".join(f"{k} " + " ".join(f"{x:.3f}" for x in v) for k, v in d.items())
                )
        report = Report("bench_checkpoint", {**vars(args), "bytes": nbytes, "fs": fs_type(work)})
        print("\nraysinga's speed against each, per round (>1: raysinga is faster)")
        ours = measured["raysinga"]
        raws = [n for n in RAW if n in measured]
        best_raw = [min(measured[n]["save"][r] for n in raws) for r in range(args.rounds)]

        def speed(name: str, peer: list[float], kind: str, goal: float) -> None:
            rounds = [p / o for p, o in zip(peer, ours[kind], strict=True)]
            report.add(Figure(name, rounds, "x", goal, "higher"))

        speed("save vs the fastest raw write of the round", best_raw, "save", 0.9)
        for peer in ("torch", "safetensors"):
            speed(f"save vs {peer}", measured[peer]["save"], "save", 1.0)
        speed(
            "cold load (every byte read and hashed) vs raw read",
            measured["raw"]["load cold"],
            "load cold",
            0.9,
        )
        for peer in ("torch", "safetensors"):
            speed(f"cold load vs {peer}", measured[peer]["load cold"], "load cold", 1.0)
        for n in raws:  # which plain strategy this disk favours
            report.add(Figure(f"{n} save", measured[n]["save"], " s"))
        if not args.no_objstore:
            got = object_store(tensors, work, args.rounds)
            print(f"\nobject store, {nbytes / (1 << 30):.2f} GiB, another task on this node:")
            # the goal is on the slowest get
            report.add(
                Figure(
                    "get, size checks only (slowest)",
                    got["fast"],
                    " s",
                    0.2,
                    value=max(got["fast"]),
                ),
                ".4f",
            )
            report.add(Figure("get, every byte hashed", got["full"], " s"), ".4f")
            report.add(Figure("driver round trip of a get", got["round trip"], " s"), ".4f")
        report.write(args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
