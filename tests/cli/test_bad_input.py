"""Every mistake a user's input can make is one ``raysinga: error:`` line naming the key or file.

Each case goes through ``cli_error`` (tests/conftest.py): ``raysinga ARGS`` in this process, a
non-zero exit, exactly one error line naming what is wrong, and no traceback. Job files are tiny
local runs (no topology: no Ray), and every mistake here fails before a step is trained; the few
warnings are checked on a two-step run that succeeds.
"""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import cli_error

from raysinga import cli

BASE = {
    "name": "tiny",
    "model": {
        "input_shape": [64],
        "layers": [
            {"kind": "dense", "name": "fc1", "units": 16, "activation": "relu"},
            {"kind": "dense", "name": "out", "units": 10},
        ],
    },
    "data": {"source": {"kind": "digits"}, "batch_size": 16},
    "updater": {"name": "sgd", "lr": 0.1},
    "train_steps": 2,
    "disp_freq": 1,
}
DEL = object()  # an edit that deletes the key
TOPOLOGY = {"preset": "sandblaster", "n_servers": 1, "workers_per_group": 2}


@pytest.fixture
def where(tmp_path) -> dict[str, str]:
    """Paths of things a user can point at by mistake, for ``{name}`` in a case's arguments."""
    (tmp_path / "afile.txt").write_text("not what you think\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage.jsonl").write_text("{not json\n")
    (tmp_path / "no_kind.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "blank.jsonl").write_text("\n")
    return {"tmp": str(tmp_path), "run": str(tmp_path / "run")}


def _job(where: dict[str, str], edits: dict | None = None, text: str | bytes | None = None) -> str:
    """The tiny job with ``edits`` (dotted paths, list indices as numbers; DEL deletes; ``{tmp}``
    in strings is filled in) as a file, or ``text`` itself."""
    path = Path(where["tmp"]) / "job.yaml"
    if text is not None:
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        return str(path)
    d = copy.deepcopy({**BASE, "run_dir": where["run"]})
    for dotted, value in (edits or {}).items():
        keys = [int(k) if k.isdigit() else k for k in dotted.split(".")]
        node = d
        for k in keys[:-1]:
            node = node[k]
        if value is DEL:
            del node[keys[-1]]
        else:
            node[keys[-1]] = _filled(value, where)
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(path)


def _filled(value, where: dict[str, str]):
    if isinstance(value, str):
        return value.format(**where)
    if isinstance(value, dict):
        return {k: _filled(v, where) for k, v in value.items()}
    return value


def _fill(items, where: dict[str, str]) -> list[str]:
    return [s.format(**where) for s in ([items] if isinstance(items, str) else items)]


# -- the job file as text: YAML the parser cannot take ------------------------------------------

TEXT = {  # id -> (the job file's text, what the error line names)
    "unclosed flow list": ("model: [\n", ["job.yaml:2:1", "not valid YAML"]),
    "tab indentation": ("model:\n\tinput_shape: [64]\n", ["job.yaml:2:1"]),
    "unclosed quote": ('name: "tiny\nseed: 0\n', ["job.yaml", "not valid YAML"]),
    "duplicate top-level key": (
        "seed: 1\nname: tiny\nseed: 2\n",
        ["job.yaml:3:1", "duplicate key 'seed'", "first at 1:1"],
    ),
    "duplicate key in a layer": (
        "model:\n  layers:\n    - {kind: dense, name: a, units: 4, units: 8}\n",
        ["job.yaml:3:40", "duplicate key 'units'", "first at 3:30"],
    ),
    "duplicate key in a section": (
        "data:\n  batch_size: 8\n  shuffle: true\n  batch_size: 16\n",
        ["job.yaml:4:3", "duplicate key 'batch_size'", "first at 2:3"],
    ),
    "not UTF-8": (b"name: caf\xe9\n", ["job.yaml", "UTF-8"]),
    "a python tag": ("seed: !!python/object/apply:os.getpid []\n", ["job.yaml:1", "python"]),
    "a scalar, not a mapping": ("just some words\n", ["(top level)", "mapping"]),
    "an empty file": ("", ["model: missing"]),
}


@pytest.mark.parametrize("case", sorted(TEXT))
def test_unreadable_job_files(case, where):
    text, named = TEXT[case]
    cli_error("train", _job(where, text=text), named=named, status=2)


# -- the job file's keys and values --------------------------------------------------------------


def _conv_net(**conv) -> list[dict]:
    return [
        {"kind": "conv2d", "name": "c", **conv},
        {"kind": "flatten", "name": "f"},
        {"kind": "dense", "name": "out", "units": 10},
    ]


EDITS = {  # id -> (edits to the tiny job, extra arguments, what the error line names)
    # unknown keys
    "unknown model key": ({"model.activation": "relu"}, [], ["model", "activation"]),
    "unknown checkpoint key": ({"checkpoint": {"keepLast": 2}}, [], ["checkpoint", "keepLast"]),
    "unknown fault key": ({"fault": {"retries": 2}}, [], ["fault", "retries"]),
    "unknown updater option": ({"updater.learning_rate": 0.1}, [], ["updater", "learning_rate"]),
    "unknown source kind": ({"data.source.kind": "digit"}, [], ["data.source", "digit"]),
    "unknown source option": (
        {"data.source.test_frac": 0.1},
        [],
        ["data.source", "test_frac"],
    ),
    "unknown conv option": (
        {
            "model.input_shape": [1, 8, 8],
            "model.layers.0": {"kind": "conv2d", "name": "c", "filters": 2, "kernal": 3},
        },
        [],
        ["model.layers[0]", "kernal"],
    ),
    "unknown schedule key": (
        {"updater.lr": {"kind": "step", "lr": 0.1, "gamma": 0.5, "step_size": 5, "warm": 1}},
        [],
        ["updater.lr"],
    ),
    "unknown worker resource": (
        {"topology": {**TOPOLOGY, "worker": {"gpu": 1}}},
        [],
        ["topology.worker", "gpu"],
    ),
    # wrong types and values
    "seed as text": ({"seed": "abc"}, [], ["seed"]),
    "negative seed": ({"seed": -1}, [], ["seed"]),
    "seed beyond 64 bits": ({"seed": 2**64}, [], ["seed", "64"]),
    "data seed beyond 64 bits": ({"data.source.seed": 2**70}, [], ["data.source.seed"]),
    "huge integer anywhere": ({"checkpoint_after": 10**30}, [], ["checkpoint_after"]),
    "dtype as a number": ({"dtype": 32}, [], ["dtype"]),
    "name with a slash": ({"name": "a/b"}, [], ["name"]),
    "empty name": ({"name": ""}, [], ["name"]),
    "run_dir a number": ({"run_dir": 5}, [], ["run_dir"]),
    "run_dir an existing file": ({"run_dir": "{tmp}/afile.txt"}, [], ["run_dir", "afile.txt"]),
    "run_dir below a file": ({"run_dir": "{tmp}/afile.txt/run"}, [], ["run_dir", "afile.txt"]),
    "checkpoint.dir below a file": (
        {"checkpoint": {"dir": "{tmp}/afile.txt/ck"}},
        [],
        ["checkpoint.dir", "afile.txt"],
    ),
    "tensorboard as text": ({"tensorboard": "yes"}, [], ["tensorboard"]),
    "unknown compression": (
        {"checkpoint": {"compression": "gzip"}},
        [],
        ["checkpoint.compression"],
    ),
    "empty checkpoint dir": ({"checkpoint": {"dir": ""}}, [], ["checkpoint.dir"]),
    "negative seconds": ({"checkpoint_every_seconds": -1}, [], ["checkpoint_every_seconds"]),
    "frequency as a fraction": ({"checkpoint_frequency": 1.5}, [], ["checkpoint_frequency"]),
    "negative test_freq": ({"test_freq": -1}, [], ["test_freq"]),
    "zero disp_freq": ({"disp_freq": 0}, [], ["disp_freq"]),
    "steps as a float": ({"train_steps": 1e3}, [], ["train_steps", "1000.0"]),
    "eval batch as text": ({"data.eval_batch_size": "big"}, [], ["data.eval_batch_size"]),
    "negative scan_bytes": ({"data.scan_bytes": -1}, [], ["data.scan_bytes"]),
    "clip_norm as text": ({"updater.clip_norm": "x"}, [], ["updater.clip_norm"]),
    "unknown async_lr rule": ({"updater.async_lr": "sqrt"}, [], ["updater.async_lr", "groups"]),
    "negative lr": ({"updater.lr": -0.1}, [], ["updater.lr"]),
    "not-a-number lr": ({"updater.lr": float("nan")}, [], ["updater.lr"]),
    "short betas": ({"updater": {"name": "adam", "lr": 0.1, "betas": [0.9]}}, [], ["betas"]),
    "digits seed as text": ({"data.source.seed": "x"}, [], ["data.source.seed"]),
    "test_fraction above 1": ({"data.source.test_fraction": 1.5}, [], ["data.source"]),
    "cache size as text": (
        {"data.source": {"kind": "arrow", "path": "s3://b/k", "cache_bytes": "4GiB"}},
        [],
        ["data.source", "cache_bytes", "4GiB"],
    ),
    "tiny cache block": (
        {"data.source": {"kind": "parquet", "path": "s3://b/k", "test": {"block_bytes": 16}}},
        [],
        ["data.source.test", "block_bytes"],
    ),
    "negative sample_shape": ({"data.source.sample_shape": [8, -8]}, [], ["data.source"]),
    "unknown loss": ({"model.loss": "hinge"}, [], ["model.loss"]),
    "fractional input_shape": ({"model.input_shape": [64.0]}, [], ["model.input_shape"]),
    "unknown activation": ({"model.layers.0.activation": "gelu"}, [], ["model.layers[0]"]),
    "dropout rate above 1": (
        {"model.layers.1": {"kind": "dropout", "name": "d", "rate": 1.5}},
        [],
        ["model.layers[1]"],
    ),
    "duplicate layer names": ({"model.layers.1.name": "fc1"}, [], ["model.layers[1].name"]),
    "layer as a word": ({"model.layers.0": "dense"}, [], ["model.layers[0]"]),
    "a date for a name": ({"name": "2024-01-01"}, [], ["name", "2024-01-01 as a date"]),
    # missing keys
    "no updater": ({"updater": DEL}, [], ["updater: missing"]),
    "no data": ({"data": DEL}, [], ["data: missing"]),
    "no input_shape": ({"model.input_shape": DEL}, [], ["model.input_shape"]),
    "no layers": ({"model.layers": DEL}, [], ["model.layers"]),
    "dense without units": ({"model.layers.0.units": DEL}, [], ["model.layers[0]", "units"]),
    "layer without a name": ({"model.layers.0.name": DEL}, [], ["model.layers[0]"]),
    "teacher without dim": (
        {"data.source": {"kind": "teacher", "n": 100, "num_classes": 10}},
        [],
        ["data.source", "dim"],
    ),
    "npy without y": ({"data.source": {"kind": "npy", "x": "x.npy"}}, [], ["data.source", "'y'"]),
    "npy file missing": (
        {"data.source": {"kind": "npy", "x": "{tmp}/nope_x.npy", "y": "{tmp}/nope_y.npy"}},
        [],
        ["nope_"],
    ),
    # topology (refused when the job is read: Ray never starts)
    "unknown preset": ({"topology": {**TOPOLOGY, "preset": "ring"}}, [], ["topology.preset"]),
    "hogwild with two workers": (
        {"topology": {**TOPOLOGY, "preset": "hogwild"}},
        [],
        ["topology", "workers_per_group"],
    ),
    "sandblaster with groups": ({"topology": {**TOPOLOGY, "n_groups": 2}}, [], ["n_groups"]),
    "staleness without downpour": (
        {"topology": {**TOPOLOGY, "staleness": 2}},
        [],
        ["topology.staleness"],
    ),
    "workers with nothing": (
        {"topology": {**TOPOLOGY, "worker": {"cpus": 0, "gpus": 0}}},
        [],
        ["topology.worker"],
    ),
    "batch below workers": (
        {"topology": {**TOPOLOGY, "workers_per_group": 4}, "data.batch_size": 2},
        [],
        ["data.batch_size"],
    ),
    "topology as a list": ({"topology": [1, 2]}, [], ["topology"]),
    "more min_groups than groups": (
        {"topology": TOPOLOGY, "fault": {"min_groups": 3}},
        [],
        ["fault.min_groups"],
    ),
    "gpu device without worker gpus": ({"topology": TOPOLOGY, "device": "gpu"}, [], ["device"]),
    # learning-rate schedules
    "unknown schedule": ({"updater.lr": {"kind": "cyclic", "lr": 0.1}}, [], ["updater.lr"]),
    "step without step_size": (
        {"updater.lr": {"kind": "step", "lr": 0.1, "gamma": 0.5}},
        [],
        ["updater.lr", "step_size"],
    ),
    "warmup without after": ({"updater.lr": {"kind": "warmup", "steps": 5}}, [], ["updater.lr"]),
    "milestones out of order": (
        {"updater.lr": {"kind": "multistep", "lr": 0.1, "gamma": 0.5, "milestones": [5, 2]}},
        [],
        ["updater.lr"],
    ),
    "cosine over zero steps": (
        {"updater.lr": {"kind": "cosine", "lr": 0.1, "steps": 0}},
        [],
        ["updater.lr"],
    ),
    # layer shapes
    "dense on images": ({"model.input_shape": [1, 8, 8]}, [], ["model.layers[0]", "flatten"]),
    "conv on flat input": (
        {"model.layers.0": {"kind": "conv2d", "name": "c", "filters": 2, "kernel": 3}},
        [],
        ["model.layers[0]"],
    ),
    "kernel larger than the image": (
        {
            "model.input_shape": [1, 8, 8],
            "model.layers.0": {"kind": "conv2d", "name": "c", "filters": 2, "kernel": 9},
        },
        [],
        ["model.layers[0]"],
    ),
    "zero pool kernel": (
        {
            "model.input_shape": [1, 8, 8],
            "model.layers.0": {"kind": "maxpool", "name": "p", "kernel": 0},
        },
        [],
        ["model.layers[0]"],
    ),
    "batchnorm on a matrix": (
        {
            "model.input_shape": [4, 16],
            "model.layers.0": {"kind": "batchnorm", "name": "bn"},
        },
        [],
        ["model.layers[0]"],
    ),
    # sizes that cannot fit
    "units as a float": ({"model.layers.0.units": 1e11}, [], ["model.layers[0]", "units"]),
    "a layer larger than memory": (
        {"model.layers.0.units": 100_000_000_000},
        [],
        ["model.layers[0]", "fc1", "bytes"],
    ),
    "a conv larger than memory": (
        {
            "model.input_shape": [1000, 1000, 1000],
            "model.layers": _conv_net(filters=1_000_000, kernel=1000),
        },
        [],
        ["model.layers[0]", "bytes"],
    ),
    "activations larger than memory": (
        {
            "model.input_shape": [1, 200_000, 200_000],
            "model.layers": _conv_net(filters=64, kernel=1),
        },
        [],
        ["model.layers[0]", "bytes", "data.batch_size"],
    ),
    "teacher larger than memory": (
        {"data.source": {"kind": "teacher", "n": 100, "dim": 2**32, "num_classes": 10}},
        [],
        ["data.source", "bytes"],
    ),
    "teacher beyond 2**63 samples": (
        {"data.source": {"kind": "teacher", "n": 2**63 - 1, "dim": 64, "num_classes": 10}},
        [],
        ["data.source.n", "n_test", "2**63"],
    ),
    "teacher n as a float": (
        {"data.source": {"kind": "teacher", "n": 1e12, "dim": 64, "num_classes": 10}},
        [],
        ["data.source.n"],
    ),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_bad_job_values(case, where):
    edits, args, named = EDITS[case]
    job = _job(where, edits)
    if case == "a date for a name":  # yaml.safe_dump quotes it; a user does not
        Path(job).write_text(Path(job).read_text().replace("'2024-01-01'", "2024-01-01"))
    cli_error("train", job, *_fill(args, where), named=_fill(named, where))


# -- --set overrides ---------------------------------------------------------------------------

SETS = {  # id -> (--set items, what the error line names)
    "unclosed list value": ("model.layers=[{", ["--set", "model.layers=[{"]),
    "a lone colon": ("seed=:", ["--set", "seed=:"]),
    "unclosed mapping value": ("updater.lr={kind: step", ["--set", "updater.lr"]),
    "unclosed quote": ('name="tiny', ["--set", "name="]),
    "a python tag": ("data.source=!!python/name:os.getpid", ["--set", "data.source"]),
    "a duplicate key": ("data={batch_size: 1, batch_size: 2}", ["--set", "batch_size"]),
    "no key": ("=5", ["--set", "=5"]),
    "into a list": ("model.layers.0.units=5", ["model.layers", "not a mapping"]),
    "an index path": ("model.layers[0].units=5", ["model", "layers[0]"]),
    "a date seed": ("seed=2018-01-01", ["seed", "2018-01-01 as a date"]),
    "a huge seed": ("seed=100000000000000000000000", ["seed"]),
    "a float seed": ("seed=1e30", ["seed"]),
    "scan_bytes as a float": ("data.scan_bytes=1e9", ["data.scan_bytes"]),
}


@pytest.mark.parametrize("case", sorted(SETS))
def test_bad_set_overrides(case, where):
    item, named = SETS[case]
    cli_error("train", _job(where), "--set", item, named=named, status=2)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just some words\n", "42\n"])
def test_set_into_a_job_file_that_is_not_a_mapping(text, where):
    """--set needs a mapping of keys to set a key in: a list, a word or a number at the top
    of the file is named as such, in one line."""
    line = cli_error(
        "train", _job(where, text=text), "--set", "train_steps=3", named=["(top level)"], status=2
    )
    assert "expected a mapping" in line and "--set train_steps=3" in line, line


# -- flags of `raysinga train` -----------------------------------------------------------------

FLAGS = {  # id -> (arguments after the job file, what the error line names)
    "--address with --local": (["--local", "--address", "127.0.0.1:1"], ["--address", "--local"]),
    "--auto-resume with --init-from": (
        ["--auto-resume", "--init-from", "{tmp}/empty"],
        ["--auto-resume", "--init-from"],
    ),
    "--init-from nowhere": (["--init-from", "{tmp}/nope"], ["{tmp}/nope"]),
    "--init-from a file": (["--init-from", "{tmp}/afile.txt"], ["afile.txt", "not a checkpoint"]),
    "--resume with nothing": (["--resume"], ["--resume"]),
    "an unknown flag": (["--epochs", "3"], ["--epochs"]),
}


@pytest.mark.parametrize("case", sorted(FLAGS))
def test_bad_train_flags(case, where):
    args, named = FLAGS[case]
    cli_error("train", _job(where), *_fill(args, where), named=_fill(named, where))


STORAGE = {  # id -> (checkpoint.dir, what the error line names); credentials never shown
    "a directory that cannot be made": (
        "/proc/nope/run",
        ["checkpoint.dir /proc/nope/run cannot be written"],
    ),
    "an object store nothing answers at": (
        "s3://KEY:SECRET@bucket/run?endpoint_override=127.0.0.1:1&scheme=http&region=us-east-1",
        ["checkpoint.dir s3://bucket/run cannot be written", "127.0.0.1:1"],
    ),
    "an unknown scheme": ("nosuch://KEY:SECRET@x/run", ["nosuch://x/run", "cannot open"]),
    "a credential pyarrow does not take": (
        "s3://bucket/run?secret_key=SECRET",
        ["secret_key=***", "cannot open"],
    ),
}


@pytest.mark.parametrize(
    "case",
    [  # the unanswered connection waits out the client's retries: 12 s
        pytest.param(c, marks=pytest.mark.slow) if "nothing answers" in c else c
        for c in sorted(STORAGE)
    ],
)
def test_storage_that_cannot_be_written(case, where):
    uri, named = STORAGE[case]
    line = cli_error("train", _job(where), "--set", f"checkpoint.dir={uri}", named=named)
    assert "SECRET" not in line and "KEY" not in line, line
    assert not Path(where["run"], "checkpoints").exists()


# -- the other commands, given paths that are not what they want ---------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A two-step run's directory: metrics.jsonl and checkpoints/step-2."""
    d = tmp_path_factory.mktemp("trained")
    job = _job({"tmp": str(d), "run": str(d / "run")})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["train", job]) == 0
    return d / "run"


PATHS = {  # id -> (arguments, what the error line names)
    "inspect nowhere": (["inspect", "{tmp}/nope"], ["{tmp}/nope"]),
    "inspect a file": (["inspect", "{tmp}/afile.txt"], ["afile.txt", "not a checkpoint"]),
    "inspect an empty directory": (["inspect", "{tmp}/empty"], ["{tmp}/empty"]),
    "inspect a run directory": (["inspect", "{run}"], ["{run}", "step-2"]),
    "verify nowhere": (["verify", "{tmp}/nope"], ["{tmp}/nope"]),
    "verify a file": (["verify", "{tmp}/afile.txt"], ["afile.txt", "not a checkpoint"]),
    "verify an empty directory": (["verify", "{tmp}/empty"], ["{tmp}/empty"]),
    "verify a bad URI": (["verify", "nosuchscheme://x/y"], ["nosuchscheme://x/y"]),
    "export nowhere": (
        ["export", "{tmp}/nope", "--format", "npz", "-o", "{tmp}/m.npz"],
        ["{tmp}/nope"],
    ),
    "export a file": (
        ["export", "{tmp}/afile.txt", "--format", "npz", "-o", "{tmp}/m.npz"],
        ["afile.txt"],
    ),
    "export an empty directory": (
        ["export", "{tmp}/empty", "--format", "npz", "-o", "{tmp}/m.npz"],
        ["{tmp}/empty"],
    ),
    "export into a missing directory": (
        ["export", "{ck}", "--format", "npz", "-o", "{tmp}/nodir/m.npz"],
        ["{tmp}/nodir"],
    ),
    "export onto a directory": (
        ["export", "{ck}", "--format", "npz", "-o", "{tmp}/empty"],
        ["{tmp}/empty", "directory"],
    ),
    "export npz as .safetensors": (
        ["export", "{ck}", "--format", "npz", "-o", "{tmp}/m.safetensors"],
        ["{tmp}/m.safetensors", ".npz"],
    ),
    "export safetensors as .npz": (
        ["export", "{ck}", "--format", "safetensors", "-o", "{tmp}/m.npz"],
        ["{tmp}/m.npz", ".safetensors"],
    ),
    "export without a suffix": (
        ["export", "{ck}", "--format", "npz", "-o", "{tmp}/model"],
        ["{tmp}/model", ".npz"],
    ),
    "export an unknown format": (["export", "{ck}", "--format", "onnx", "-o", "m.onnx"], []),
    "plot nowhere": (["plot", "{tmp}/nope"], ["{tmp}/nope"]),
    "plot a checkpoint": (["plot", "{ck}"], ["metrics.jsonl"]),
    "plot an empty directory": (["plot", "{tmp}/empty"], ["{tmp}/empty"]),
    "plot garbage": (["plot", "{tmp}/garbage.jsonl"], ["garbage.jsonl:1"]),
    "plot records without a kind": (["plot", "{tmp}/no_kind.jsonl"], ["no_kind.jsonl:1"]),
    "plot nothing to draw": (["plot", "{tmp}/blank.jsonl"], ["blank.jsonl"]),
    "plot into a file": (["plot", "{run}", "-o", "{tmp}/afile.txt"], ["afile.txt"]),
    "graph nowhere": (["graph", "{tmp}/nope.yaml"], ["{tmp}/nope.yaml"]),
    "graph a directory": (["graph", "{tmp}/empty"], ["{tmp}/empty"]),
    "graph as a pdf": (["graph", "{job}", "-o", "{tmp}/net.pdf"], ["net.pdf"]),
    "graph below a file": (["graph", "{job}", "-o", "{tmp}/afile.txt/net.png"], ["afile.txt"]),
    "graph with a bad --set": (["graph", "{job}", "--set", "seed=:"], ["--set", "seed=:"]),
}


@pytest.mark.parametrize("case", sorted(PATHS))
def test_bad_paths_for_the_other_commands(case, where, trained):
    args, named = PATHS[case]
    where = {**where, "run": str(trained), "ck": str(trained / "checkpoints" / "step-2")}
    where["job"] = _job(where)
    cli_error(*_fill(args, where), named=_fill(named, where))


# -- warnings: the run goes on ------------------------------------------------------------------


def _run(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return code, err.getvalue()


FAULT_WARNING = "raysinga: warning: fault.* applies to distributed runs; ignored"


def test_fault_settings_in_a_job_without_topology_are_a_warning(where):
    code, err = _run("train", _job(where, {"fault": {"max_failures": 5}}))
    assert code == 0 and FAULT_WARNING in err.splitlines(), err


def test_fault_settings_with_local_are_a_warning(where):
    job = _job(where, {"topology": TOPOLOGY, "fault": {"window_s": 60}})
    code, err = _run("train", job, "--local")
    assert code == 0 and FAULT_WARNING in err.splitlines(), err


def test_no_fault_warning_without_fault_settings(where):
    code, err = _run("train", _job(where), "--local")
    assert code == 0 and "warning" not in err, err


def test_test_freq_without_a_test_split_is_a_warning(where):
    tmp = Path(where["tmp"])
    rng = np.random.default_rng(0)
    np.save(tmp / "x.npy", rng.random((40, 64), dtype=np.float32))
    np.save(tmp / "y.npy", rng.integers(0, 10, 40))
    source = {"kind": "npy", "x": str(tmp / "x.npy"), "y": str(tmp / "y.npy")}
    code, err = _run("train", _job(where, {"data.source": source, "test_freq": 1}))
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("raysinga: warning:")]
    assert len(warning) == 1 and "test_freq" in warning[0] and "test" in warning[0], err


def test_address_without_topology_is_a_warning(where):
    """A job without a topology runs in this process: the address is not even dialled."""
    code, err = _run("train", _job(where), "--address", "127.0.0.1:1")
    assert code == 0 and "raysinga: warning: --address" in err, err


def test_largest_seed_trains_and_checkpoints(where):
    code, err = _run("train", _job(where, {"seed": 2**64 - 1}))
    assert code == 0, err
    assert (Path(where["run"]) / "checkpoints" / "step-2").is_dir()


def test_scan_bytes_is_a_data_key_with_a_default():
    from raysinga import config

    assert "scan_bytes" in config.DATA_KEYS
    d = config.parse_yaml(yaml.safe_dump(BASE))
    assert config.from_dict(d).data.scan_bytes == 128 * 2**20
    d["data"]["scan_bytes"] = 0
    assert config.from_dict(d).data.scan_bytes == 0
