"""Parameter reuse by name, resharding between server counts, and the checkpoint CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli

from raysinga import checkpoint as C
from raysinga.checkpoint import CheckpointError, TensorInfo


def test_match_reports_matched_missing_unexpected_and_mismatched():
    arrays = {
        "base/fc1/W": np.zeros((4, 3)),
        "base/fc1/b": np.zeros(3),
        "base/out/W": np.zeros((3, 10)),
        "base/aux/W": np.zeros(2),
    }
    target = {"fc1/W": (4, 3), "fc1/b": (3,), "head/W": (3, 5), "new/W": (5, 2)}
    out, rep = C.match(arrays, target, rename={"out/": "head/"}, strip_prefix="base/")
    assert rep.matched == ["fc1/W", "fc1/b"] and set(out) == {"fc1/W", "fc1/b"}
    assert rep.mismatched == [("head/W", (3, 10), (3, 5))]
    assert rep.unexpected == ["base/aux/W"]
    assert rep.missing == ["new/W"]  # head/W is there, with the wrong shape
    assert "shape mismatch: head/W: checkpoint [3, 10], model [3, 5]" in str(rep)
    with pytest.raises(CheckpointError, match=r"(?s)does not fit this model.*missing.*new/W"):
        C.match(arrays, target, rename={"out/": "head/"}, strip_prefix="base/", strict=True)
    _, perfect = C.match({"a": np.zeros(2)}, {"a": (2,)}, strict=True)
    assert perfect.perfect


def test_two_names_mapping_to_one_are_refused():
    with pytest.raises(CheckpointError, match="two checkpoint tensors map to 'x'"):
        C.match({"a": np.zeros(1), "b": np.zeros(1)}, {"x": (1,)}, rename={"a": "x", "b": "x"})


def save_sliced(root, n_shards: int, w: np.ndarray, step: int = 1):
    """``w`` cut into ``n_shards`` flat slices, one per shard, as ``n_shards`` servers would."""
    tmp = C.begin(root, step)
    bounds = [w.size * i // n_shards for i in range(n_shards + 1)]
    shards = [
        C.write_shard(
            tmp,
            k,
            [
                (
                    TensorInfo("W", "param", w.shape, str(w.dtype), bounds[k], bounds[k + 1], 3),
                    w.reshape(-1)[bounds[k] : bounds[k + 1]],
                )
            ],
        )
        for k in range(n_shards)
    ]
    return C.commit(tmp, step, shards, {"servers": n_shards})


@pytest.mark.parametrize("m,n", [(1, 3), (3, 1), (3, 2), (4, 7)])
def test_a_checkpoint_of_m_servers_loads_into_n(tmp_path, m, n):
    w = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    ck = C.Checkpoint.open(save_sliced(tmp_path, m, w))
    np.testing.assert_array_equal(ck.array("W"), w)
    bounds = [w.size * i // n for i in range(n + 1)]
    parts = [ck.flat_range("W", bounds[k], bounds[k + 1]) for k in range(n)]
    np.testing.assert_array_equal(np.concatenate(parts), w.reshape(-1))
    with pytest.raises(ValueError, match="outside tensor"):
        ck.flat_range("W", 0, w.size + 1)


def cli(*args):
    return run_cli(*args, timeout=120)


def test_inspect_verify_export_from_the_command_line(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = str(save_sliced(tmp_path, 2, w, step=5))
    r = cli("inspect", path)
    assert r.returncode == 0 and "step 5" in r.stdout and "3x4" in r.stdout
    info = json.loads(cli("inspect", path, "--json").stdout)
    assert info["step"] == 5 and info["tensors"][0]["slices"] == 2
    assert cli("verify", path).returncode == 0
    out = tmp_path / "w.safetensors"
    assert cli("export", path, "--format", "safetensors", "-o", str(out)).returncode == 0
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(str(out))["W"], w)
    npz = tmp_path / "w.npz"
    assert cli("export", path, "--format", "npz", "-o", str(npz)).returncode == 0
    np.testing.assert_array_equal(np.load(npz)["W"], w)
    # A corrupt shard: verify fails with the file's name, exit 1, no traceback.
    shard = tmp_path / "step-5" / "shard-1.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = cli("verify", path)
    assert r.returncode == 1 and "shard-1.arrow" in r.stderr and "Traceback" not in r.stderr
    r = cli("inspect", str(tmp_path))
    assert r.returncode == 1 and "not a checkpoint" in r.stderr
