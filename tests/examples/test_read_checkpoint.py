"""examples/read_checkpoint.py, the reader written from docs/checkpoint-format.md alone, against
raysinga's own loader on checkpoints of many kinds: the same tensors bit for bit, and every
tampered copy refused. The document's tables and worked example are checked against what
raysinga writes, so a change of the format fails here until the document and the reader follow."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import start_ray

from raysinga import config
from raysinga.checkpoint import Checkpoint
from raysinga.checkpoint.format import FORMAT_VERSION
from raysinga.checkpoint.writer import SCHEMA
from raysinga.optim.optimizers import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "checkpoint-format.md").read_text()
QUIET = {"log": lambda line: None}
_spec = importlib.util.spec_from_file_location(
    "read_checkpoint", ROOT / "examples/read_checkpoint.py"
)
reader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reader)

MLP = """{input_shape: [64], layers: [{kind: dense, name: fc1, units: 24, activation: relu},
  {kind: batchnorm, name: bn1}, {kind: dense, name: out, units: 10}]}"""
CNN = """{input_shape: [1, 8, 8], layers: [{kind: conv2d, name: conv1, filters: 4, kernel: 3,
  padding: 1, activation: relu}, {kind: batchnorm, name: bn1}, {kind: maxpool, name: pool,
  kernel: 2}, {kind: flatten, name: flat}, {kind: dense, name: out, units: 10}]}"""
# name: (distributed, --set overrides); every one trains 3 steps and checkpoints at the end
KINDS = {
    "sgd-momentum": (False, ["updater={name: sgd, lr: 0.05, momentum: 0.9, nesterov: true}"]),
    "adam-zstd": (False, ["updater={name: adam, lr: 0.01}", "checkpoint.compression=zstd"]),
    "adagrad-lz4": (False, ["updater={name: adagrad, lr: 0.05}", "checkpoint.compression=lz4"]),
    "rmsprop-float64": (
        False,
        ["updater={name: rmsprop, lr: 0.01, momentum: 0.5, centered: true}", "dtype=float64"],
    ),
    "adamw": (False, ["updater={name: adamw, lr: 0.01}"]),
    "local-cnn-two-workers": (
        False,
        [f"model={CNN}", "data.source={kind: digits, sample_shape: [1, 8, 8]}"]
        + ["topology={workers_per_group: 2}"],
    ),
    "sliced-two-servers-cnn-lz4": (
        True,
        [f"model={CNN}", "data.source={kind: digits, sample_shape: [1, 8, 8]}"]
        + ["topology={n_servers: 2, workers_per_group: 2, slice_bytes: 512}"]
        + ["checkpoint.compression=lz4", "updater={name: adam, lr: 0.01}"],
    ),
    "downpour-two-groups": (
        True,
        ["topology={preset: downpour, n_servers: 2, n_groups: 2, staleness: 2, slice_bytes: 1024}"]
        + ["checkpoint.compression=zstd"],
    ),
}


def _job(d: Path, sets: list[str]) -> config.JobConfig:
    d.mkdir(parents=True)
    (d / "job.yaml").write_text(
        f"name: {d.name}\nseed: 3\nmodel: {MLP}\ndata: {{source: {{kind: digits}}, batch_size: 16}}"
        "\nupdater: {name: sgd, lr: 0.05, momentum: 0.9}\ntrain_steps: 3\ndisp_freq: 3\n"
    )
    return config.load(d / "job.yaml", [f"run_dir={d}", *sets])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from raysinga.distributed import DistributedTrainer  # noqa: PLC0415
    from raysinga.run.trainer import Trainer  # noqa: PLC0415

    root, out = tmp_path_factory.mktemp("kinds"), {}
    for name, (distributed, sets) in KINDS.items():
        cfg = _job(root / name, sets)
        if distributed:
            start_ray()
        (DistributedTrainer if distributed else Trainer)(cfg, **QUIET).fit()
        (out[name],) = Path(cfg.checkpoint_dir).glob("step-*")  # the final one
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_reader_returns_raysingas_tensors_bit_for_bit(checkpoints, kind):
    manifest, arrays = reader.read_checkpoint(str(checkpoints[kind]))
    ck = Checkpoint.open(checkpoints[kind])
    assert sorted(arrays) == sorted(ck.names())
    for name, a in arrays.items():
        want = ck.array(name)
        assert (a.dtype, a.shape) == (want.dtype, want.shape), name
        assert a.tobytes() == np.ascontiguousarray(want).tobytes(), name
    assert manifest == ck.manifest


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_reader_refuses_every_tampered_file(checkpoints, kind, tmp_path):
    src = checkpoints[kind]
    for f in sorted(p.name for p in src.iterdir()):
        for where in (0.5, 0.97):
            copy = tmp_path / f"{f}-{where}"
            shutil.copytree(src, copy)
            data = bytearray((copy / f).read_bytes())
            data[int(len(data) * where)] ^= 0x10
            (copy / f).write_bytes(bytes(data))
            with pytest.raises(reader.Corrupt):
                reader.read_checkpoint(str(copy))


def test_training_checkpoints_hold_what_the_document_says(checkpoints):
    for kind, path in checkpoints.items():
        m, arrays = reader.read_checkpoint(str(path))
        run, names = m["meta"]["run"], {t["file"] for t in m["files"]}
        topo = run["topology"] or {"n_servers": 1}
        servers = 1 if not KINDS[kind][0] else topo["n_servers"]
        assert names == {"params.meta", *(f"shard-{k}.arrow" for k in range(servers + 1))}
        # the driver's shard, the last, holds the state; the servers', the rest
        assert all((t["kind"] == "state") == (t["shard"] == servers) for t in m["tensors"]), kind
        assert run["history"][-1] == {"kind": "checkpoint", "step": m["step"]}
        assert m["step"] == max(run["steps"]) and path.name == f"step-{m['step']}"
        assert run["config"]["train_steps"] == 3 and "updater" in run["config"]
        opt = OPTIMIZERS[run["optimizer"]["name"]]
        slots = opt._slot_names(opt(**run["optimizer"]["hparams"]).hparams)
        params = {t["name"] for t in m["tensors"] if t["kind"] == "param"}
        want_slots = {f"{p}/{s}" for p in params for s in slots}
        assert {t["name"] for t in m["tensors"] if t["kind"] == "slot"} == want_slots
        assert set(run["optimizer"]["counts"]) == params
        states = {t["name"]: t for t in m["tensors"] if t["kind"] == "state"}
        assert all(t["version"] == 0 for t in states.values())
        workers = sorted({n.split("/")[1] for n in states if n.startswith("worker/")})
        plain = {n for n in states if not n.startswith("worker/")}
        assert plain == {"bn1/running_mean", "bn1/running_var"}
        for w in workers:
            assert {n for n in states if n.startswith(f"worker/{w}/")} == {
                f"worker/{w}/{n}" for n in plain
            }
            assert re.fullmatch(r"g\d+w\d+", w)
        for n in plain:  # group 0 / worker 0's under the plain names
            assert arrays[n].tobytes() == arrays[f"worker/g0w0/{n}"].tobytes()
        if kind == "local-cnn-two-workers":  # one process: its own worker only
            assert workers == ["g0w0"] and topo["workers_per_group"] == 2
        elif kind == "sliced-two-servers-cnn-lz4":
            assert workers == ["g0w0", "g0w1"]
            assert len({t["shard"] for t in m["tensors"] if t["name"] == "out/W"}) == 2
        elif kind == "downpour-two-groups":
            assert len(run["steps"]) == 2 and workers == ["g0w0", "g1w0"]
            assert sum(run["optimizer"]["counts"].values()) == sum(run["steps"]) * len(params)
        if kind == "rmsprop-float64":
            assert all(t["dtype"] == "float64" for t in m["tensors"] if t["kind"] != "state")


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading``, cells without their backticks."""
    return [[c.strip("`") for c in r] for r in _raw_table(heading)]


def test_the_document_is_the_format_raysinga_writes(checkpoints):
    assert f"# The checkpoint format, version {FORMAT_VERSION}\n" in DOC
    assert reader.VERSION == FORMAT_VERSION
    assert reader.SCHEMA.equals(SCHEMA, check_metadata=True) and str(reader.SCHEMA) == str(SCHEMA)
    columns = [(f.name, str(f.type), "yes" if f.nullable else "no") for f in SCHEMA]
    assert [tuple(r[:3]) for r in _table("## `shard-<K>.arrow`")] == columns
    documented = {
        r[0].strip("`"): set(re.findall(r"`([a-z_]+)`", r[1]))
        for r in _raw_table("### Optimizer slots")
    }
    assert set(documented) == set(OPTIMIZERS)
    for name, opt in OPTIMIZERS.items():  # every slot the optimizer can have
        flags = {"sgd": {"momentum": 0.9}, "rmsprop": {"momentum": 0.9, "centered": True}}
        hparams = opt(**flags.get(name, {})).hparams
        assert documented[name] == set(opt._slot_names(hparams)), name
    m = Checkpoint.open(checkpoints["sgd-momentum"]).manifest
    run_keys = {r[0] for r in _table('## Training checkpoints: `meta["run"]`')}
    assert run_keys == set(m["meta"]["run"])
    example = json.loads(DOC.split("```json\n", 1)[1].split("```", 1)[0])
    assert set(example) == set(m) and set(example["meta"]["run"]) == set(m["meta"]["run"])
    assert set(example["files"][0]) == set(m["files"][0])
    assert set(example["tensors"][0]) == set(m["tensors"][0])
    spec = json.dumps(
        example["meta"]["run"]["model"]["spec"], sort_keys=True, separators=(",", ":")
    )
    import hashlib  # noqa: PLC0415

    assert hashlib.sha256(spec.encode()).hexdigest() == example["meta"]["run"]["model"]["digest"]


def _raw_table(heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading``, cells as written (backticks kept)."""
    text = DOC.split(heading, 1)[1]
    block = text[text.index("\n|") + 1 :].split("\n\n", 1)[0]
    rows = [r.strip().strip("|").split("|") for r in block.splitlines()]
    return [[c.strip() for c in r] for r in rows[2:]]


def test_the_reader_imports_nothing_but_numpy_pyarrow_msgpack_xxhash():
    import ast  # noqa: PLC0415

    tree = ast.parse((ROOT / "examples/read_checkpoint.py").read_text())
    names = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names - set(sys.stdlib_module_names) == {"numpy", "pyarrow", "msgpack", "xxhash"}
    assert len((ROOT / "examples/read_checkpoint.py").read_text().splitlines()) <= 160


def test_the_reader_runs_as_its_docstring_says(checkpoints):
    import subprocess  # noqa: PLC0415

    path = checkpoints["sliced-two-servers-cnn-lz4"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples/read_checkpoint.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "every checksum verified" in r.stdout and "worker/g0w1/bn1/running_mean" in r.stdout
