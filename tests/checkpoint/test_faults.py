"""Checkpoint faults: flipped bytes, truncations, fuzzed files, SIGKILLed writers, full disk."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from raysinga.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    begin,
    commit,
    latest,
    prune,
    save,
    steps,
    write_shard,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Two shards, a few tiny tensors (one cut across both shards), metadata."""
    root = tmp_path_factory.mktemp("pristine")
    v = np.arange(6, dtype=np.float32)
    tmp = begin(root, 4)
    s0 = write_shard(
        tmp,
        0,
        [
            (TensorInfo("a/W", "param", (2, 3), "float32", 0, 4), v[:4]),
            (TensorInfo("n", "state", (), "int64", 0, 1), np.int64(9)),
        ],
    )
    s1 = write_shard(
        tmp,
        1,
        [
            (TensorInfo("a/W", "param", (2, 3), "float32", 4, 6), v[4:]),
            (TensorInfo("a/W/m", "slot", (3,), "float16", 0, 3), np.ones(3, np.float16)),
            (TensorInfo("e", "param", (0,), "uint8", 0, 0), np.zeros(0, np.uint8)),
        ],
    )
    final = Path(commit(tmp, 4, [s0, s1], {"cursor": 17, "seeds": [1, 2]}).path)
    ck = Checkpoint.open(final)
    np.testing.assert_array_equal(ck.array("a/W"), v.reshape(2, 3))
    assert sorted(os.listdir(final)) == [
        "manifest.msgpack",
        "params.meta",
        "shard-0.arrow",
        "shard-1.arrow",
    ]
    return final


FILES = ["manifest.msgpack", "params.meta", "shard-0.arrow", "shard-1.arrow"]


@pytest.fixture
def scratch(pristine, tmp_path) -> Path:
    d = tmp_path / "step-4"
    shutil.copytree(pristine, d)
    return d


def _expect_error(d: Path, name: str, verify: str) -> None:
    try:
        Checkpoint.open(d, verify=verify)
    except CheckpointError as e:
        assert name in str(e), f"error does not name {name}: {e}"
    else:
        raise AssertionError(f"{name}: corruption not detected (verify={verify})")


@pytest.mark.parametrize("name", FILES)
def test_every_flipped_byte_is_caught(pristine, scratch, name):
    good = (pristine / name).read_bytes()
    target = scratch / name
    try:
        for i in range(len(good)):
            bad = bytearray(good)
            bad[i] ^= 0xFF
            target.write_bytes(bad)
            _expect_error(scratch, name, "full")
    finally:
        target.write_bytes(good)
    Checkpoint.open(scratch, verify="full")


@pytest.mark.parametrize("name", FILES)
def test_every_truncation_is_caught(pristine, scratch, name):
    good = (pristine / name).read_bytes()
    target = scratch / name
    try:
        for n in range(len(good)):
            target.write_bytes(good[:n])
            _expect_error(scratch, name, "full")
            _expect_error(scratch, name, "fast")
    finally:
        target.write_bytes(good)
    Checkpoint.open(scratch, verify="fast")


@pytest.mark.parametrize("name", FILES)
def test_missing_file_is_caught(scratch, name):
    (scratch / name).unlink()
    _expect_error(scratch, name, "fast")


def _mutate(rng: random.Random, good: bytes) -> bytes:
    b = bytearray(good)
    op = rng.randrange(7)
    if op == 0:  # insert
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 64))
    elif op == 1 and b:  # delete a range
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 64)]
    elif op == 2 and b:  # overwrite a range in place (same size: only checksums/parsing see it)
        i = rng.randrange(len(b))
        n = min(rng.randint(1, 16), len(b) - i)
        b[i : i + n] = rng.randbytes(n)
    elif op == 3:  # garbage of a random size
        b = bytearray(rng.randbytes(rng.randint(0, 2 * len(b) + 16)))
    elif op == 4:  # garbage of the same size
        b = bytearray(rng.randbytes(len(b)))
    elif op == 5:
        b = bytearray()
    else:  # a few single-byte overwrites anywhere (hits Arrow metadata in shards)
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def test_fuzzed_files_raise_only_checkpoint_errors(pristine, scratch):
    rng = random.Random(1234)
    originals = {n: (pristine / n).read_bytes() for n in FILES}
    outcomes = {"error": 0, "opened": 0}
    for case in range(600):
        names = rng.sample(FILES, rng.choice([1, 1, 1, 2]))
        mutated = {n: _mutate(rng, originals[n]) for n in names}
        try:
            for n, data in mutated.items():
                (scratch / n).write_bytes(data)
            changed = any(data != originals[n] for n, data in mutated.items())
            for verify in ("full", "fast"):
                try:
                    ck = Checkpoint.open(scratch, verify=verify)
                except CheckpointError:
                    outcomes["error"] += 1
                    continue
                except Exception as e:  # noqa: BLE001
                    raise AssertionError(
                        f"case {case}: {names} verify={verify}: {type(e).__name__}: {e}"
                    ) from e
                outcomes["opened"] += 1
                if verify == "full":
                    assert not changed, f"case {case}: corrupt {names} opened with verify=full"
                else:  # fast opens only same-size changes to shards' contents
                    assert "manifest.msgpack" not in names or not changed
                try:
                    for name in ck.names(None):
                        ck.array(name)
                except CheckpointError:
                    pass
        finally:
            for n in names:
                (scratch / n).write_bytes(originals[n])
    assert outcomes["error"] > 500
    Checkpoint.open(scratch, verify="full")


# --- a writer killed at random moments ----------------------------------------------------------

CHILD = r"""
import sys
import numpy as np
from raysinga.checkpoint import save

root, step = sys.argv[1], int(sys.argv[2])
n = 1 << 19  # 3 tensors x 2 MiB of float32
base = np.arange(n, dtype=np.float32)
print("ready", flush=True)
while True:
    params = {f"layer{i}/W": base + (step * 10 + i) for i in range(3)}
    save(root, step, params, slots={"layer0/W/m": np.full(1000, step, np.int64)}, meta={"s": step})
    print(step, flush=True)
    step += 1
"""


def _check_valid(d: Path) -> None:
    ck = Checkpoint.open(d, verify="full")
    s = ck.step
    assert d.name == f"step-{s}" and ck.meta == {"s": s}
    for i in range(3):
        w = ck.array(f"layer{i}/W")
        assert w.shape == (1 << 19,) and w[0] == s * 10 + i and w[-1] == (1 << 19) - 1 + s * 10 + i
    assert (ck.array("layer0/W/m") == s).all()


@pytest.mark.slow
def test_sigkilled_writer_never_leaves_a_valid_looking_broken_checkpoint(tmp_path):
    rng = random.Random(99)
    root = tmp_path / "run"
    save(
        root,
        0,
        {f"layer{i}/W": np.arange(1 << 19, dtype=np.float32) + i for i in range(3)},
        slots={"layer0/W/m": np.zeros(1000, np.int64)},
        meta={"s": 0},
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    deadline = time.monotonic() + 25
    kills = 0
    while kills < 20 and time.monotonic() < deadline:
        before = steps(root)
        nxt = before[0] + 1
        p = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root), str(nxt)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            for _ in range(rng.choice([0, 1, 1, 2])):  # often after a save or two, mid-next
                assert p.stdout.readline().strip().isdigit(), p.stderr.read()
            time.sleep(rng.uniform(0, 0.15))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        assert p.returncode == -signal.SIGKILL, p.stderr.read()
        kills += 1
        after = steps(root)
        assert set(before) <= set(after)
        for s in after:  # every step dir that exists is complete and right
            _check_valid(root / f"step-{s}")
        got = latest(root)
        assert got.checkpoint is not None and got.checkpoint.step == after[0]
        assert got.skipped == []
    assert kills >= 10
    assert steps(root)[0] > 0, "the writer never finished a save; the kills test nothing"
    prune(root, keep_last=2)
    assert not [d for d in os.listdir(root) if ".tmp-" in d]
    assert len(steps(root)) == 2
    # the lock of the last (dead) writer is taken over
    save(root, 10_000, {"w": np.ones(1)})


# --- full disk ----------------------------------------------------------------------------------


def test_full_disk(small_fs):
    root = small_fs / "run"
    small = {"w": np.arange(25_000, dtype=np.float32)}  # 100 kB
    save(root, 1, small)
    big = {"w": np.arange(1 << 20, dtype=np.float32)}  # 4 MiB > 2 MiB
    with pytest.raises(CheckpointError, match="could not write") as e:
        save(root, 2, big)
    assert "No space left" in str(e.value) or "space" in str(e.value).lower()
    assert steps(root) == [1]
    assert sorted(os.listdir(root)) == ["step-1"]  # no temp dir, no lock left behind
    ck = Checkpoint.open(root / "step-1", verify="full")
    np.testing.assert_array_equal(ck.array("w"), small["w"])
    save(root, 3, small)  # the space was given back
    assert latest(root).checkpoint.step == 3
