"""The job's own modules (its ``modules`` key; raysinga/nn/usercode.py): found relative to the
job file, importable here, recorded so that a resume finds them, and refused in one line where
they are not what a module is."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raysinga import config
from raysinga.cluster import shipping
from raysinga.nn import usercode
from raysinga.nn.model import recorded_spec

LAYER = """
from raysinga.nn import Layer

class Twice(Layer):
    def forward(self, p, s, x, ctx):
        return x * 2

    def backward(self, dy):
        return dy * 2, {}
"""

JOB = """
name: mine
modules: [{module}]
model:
  input_shape: [4]
  layers:
    - {{kind: dense, name: fc, units: 3}}
    - {{kind: "{name}:Twice", name: tw}}
data:
  source: {{kind: teacher, n: 64, dim: 4, num_classes: 3}}
  batch_size: 8
updater: {{name: sgd, lr: 0.1}}
train_steps: 2
"""


@pytest.fixture
def unimported():
    """Modules a test imports by a name of its own are forgotten after it."""
    before = set(sys.modules)
    path = list(sys.path)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("ucmod_"):
            del sys.modules[name]
    sys.path[:] = path


def job_dir(tmp_path: Path, name: str, package: bool = False) -> Path:
    d = tmp_path / "jobs"
    code = d / "code"
    if package:
        (code / name).mkdir(parents=True)
        (code / name / "__init__.py").write_text(textwrap.dedent(LAYER))
        module = f"code/{name}"
    else:
        code.mkdir(parents=True)
        (code / f"{name}.py").write_text(textwrap.dedent(LAYER))
        module = f"code/{name}.py"
    (d / "job.yaml").write_text(JOB.format(module=module, name=name))
    return d


@pytest.mark.parametrize("package", [False, True], ids=["file", "package"])
def test_a_jobs_modules_are_found_from_the_job_file_and_recorded_whole(
    tmp_path, monkeypatch, unimported, package
):
    name = f"ucmod_{'pkg' if package else 'file'}"
    d = job_dir(tmp_path, name, package)
    monkeypatch.chdir(tmp_path)  # elsewhere than the job file
    cfg = config.load(d / "job.yaml")
    want = str((d / "code" / (name if package else f"{name}.py")).resolve())
    assert cfg.modules == [want] and cfg.raw["modules"] == [want]
    assert cfg.model.own_kinds() == [f"{name}:Twice"]
    del sys.modules[name]
    sys.path.remove(str(Path(want).parent))
    run = {"config": cfg.raw, "model": {"spec": cfg.model.to_dict()}}
    assert recorded_spec(run, "checkpoint here") == cfg.model  # the recorded path found anew


def test_a_recorded_module_that_is_gone_names_the_checkpoint_and_the_module(tmp_path, unimported):
    d = job_dir(tmp_path, "ucmod_gone")
    cfg = config.load(d / "job.yaml")
    del sys.modules["ucmod_gone"]
    sys.path.remove(str(d / "code"))
    (d / "code" / "ucmod_gone.py").unlink()
    run = {"config": cfg.raw, "model": {"spec": cfg.model.to_dict()}}
    with pytest.raises(ValueError) as e:
        recorded_spec(run, "checkpoint runs/mine/checkpoints/step-2")
    assert str(e.value) == (
        "checkpoint runs/mine/checkpoints/step-2: layer kind 'ucmod_gone:Twice' comes from "
        f"module 'ucmod_gone', recorded at {d / 'code' / 'ucmod_gone.py'}, which no longer "
        "exists: put it back there, or where this process imports it from (PYTHONPATH)"
    )


@pytest.mark.parametrize(
    ("given", "line"),
    [
        (["nothere.py"], "modules[0]: nothere.py: no such file or directory (relative to {base})"),
        (["job.yaml"], "modules[0]: job.yaml: not a Python file (.py) or package directory"),
        (["plain"], "modules[0]: plain: a directory without __init__.py, not a package"),
        (["a.py", "b/a.py"], "modules[1]: b/a.py: module 'a' is also modules[0]"),
        (["my-layers.py"], "modules[0]: my-layers.py: 'my-layers' cannot be imported by that name"),
        ("a.py", "modules: expected a list of paths, got 'a.py'"),
    ],
)
def test_modules_that_are_not_modules_are_refused_in_one_line(tmp_path, unimported, given, line):
    (tmp_path / "job.yaml").write_text("")
    (tmp_path / "plain").mkdir()
    (tmp_path / "b").mkdir()
    for f in ("a.py", "b/a.py", "my-layers.py"):
        (tmp_path / f).write_text("")
    with pytest.raises(ValueError) as e:
        usercode.resolve(given, tmp_path)
    assert str(e.value) == line.format(base=tmp_path)


def test_a_module_shipped_here_but_not_at_its_path_passes(tmp_path, monkeypatch, unimported):
    (tmp_path / "ucmod_shipped.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # as Ray's py_modules puts it on a node
    assert usercode.resolve(["/elsewhere/ucmod_shipped.py"], tmp_path) == [
        "/elsewhere/ucmod_shipped.py"
    ]


def test_a_file_module_is_shipped_as_a_package_of_its_name(tmp_path):
    (tmp_path / "ucmod_ship.py").write_text("X = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    cache = tmp_path / "cache"
    got = shipping.user_packages([str(tmp_path / "ucmod_ship.py"), str(tmp_path / "pkg")], cache)
    assert Path(got[0]).name == "ucmod_ship" and got[1] == str(tmp_path / "pkg")
    assert (Path(got[0]) / "__init__.py").read_text() == "X = 1\n"
    assert shipping.user_packages([str(tmp_path / "ucmod_ship.py")], cache) == got[:1]  # cached
    (tmp_path / "ucmod_ship.py").write_text("X = 2\n")
    assert shipping.user_packages([str(tmp_path / "ucmod_ship.py")], cache) != got[:1]
    env = shipping.runtime_env([str(tmp_path / "pkg")], own=False)
    assert env == {"py_modules": [str(tmp_path / "pkg")]}
    assert shipping.runtime_env([], own=False) is None


SCALE_V1 = """
import numpy as np
from raysinga.nn import Layer

class Scale(Layer):
    WIDTH = {width}

    def param_shapes(self):
        return {{"s": (self.WIDTH,)}}

    def init_param(self, local, shape, rng):
        return np.ones(shape)

    def forward(self, p, s, x, ctx):
        self._cache = (x, p["s"])
        return x * p["s"][: x.shape[-1]]

    def backward(self, dy):
        x, s = self._cache
        g = np.zeros_like(s)
        g[: x.shape[-1]] = (dy * x).sum(axis=0)
        return dy * s[: x.shape[-1]], {{"s": g}}
"""


def test_a_layer_whose_parameters_changed_since_the_checkpoint_is_one_line(tmp_path, unimported):
    from raysinga.checkpoint import CheckpointError
    from raysinga.run import Trainer

    d = tmp_path / "job"
    d.mkdir()
    (d / "ucmod_scale.py").write_text(textwrap.dedent(SCALE_V1.format(width=3)))
    text = JOB.format(module="ucmod_scale.py", name="ucmod_scale").replace(":Twice", ":Scale")
    (d / "job.yaml").write_text(text + "checkpoint_frequency: 2\n")
    Trainer(config.load(d / "job.yaml", [f"run_dir={d}"]), log=None).fit()
    ck = d / "checkpoints" / "step-2"
    shown = subprocess.run(
        [sys.executable, "-m", "raysinga.cli", "inspect", str(ck)], capture_output=True, text=True
    )
    assert (
        f"layers and losses of the user's own: ucmod_scale:Scale (modules: {d / 'ucmod_scale.py'})"
        in shown.stdout
    ), shown.stdout + shown.stderr
    out = tmp_path / "model.pt"
    command = [sys.executable, "-m", "raysinga.cli", "export", str(ck), "--format", "torch"]
    command += ["-o", str(out)]
    export = subprocess.run(command, capture_output=True, text=True)
    assert export.returncode == 2 and not out.exists()  # bad input
    assert export.stderr.strip().splitlines() == [
        "raysinga: error: layer 'tw' (ucmod_scale:Scale) does not say how its parameters map to "
        "PyTorch's: give its class torch_names, ((name, PyTorch name, transposed), ...) "
        "(docs/layers.md)"
    ], export.stderr
    del sys.modules["ucmod_scale"]
    (d / "ucmod_scale.py").write_text(textwrap.dedent(SCALE_V1.format(width=5)))
    cfg = config.load(d / "job.yaml", [f"run_dir={d}", "train_steps=4"])
    with pytest.raises(CheckpointError) as e:
        Trainer(cfg, log=None, resume=True).fit()
    line = str(e.value)
    assert "\n" not in line
    assert line.endswith(
        "step-2: parameter 'tw/s' is [3] in the checkpoint and [5] in this model: the checkpoint "
        "does not fit this model (to start a new run from what matches, use --init-from instead "
        "of --resume)"
    )
    (d / "ucmod_scale.py").unlink()
    export = subprocess.run(command, capture_output=True, text=True)
    assert export.stderr.strip().splitlines() == [
        f"raysinga: error: checkpoint {ck}: layer kind 'ucmod_scale:Scale' comes from module "
        f"'ucmod_scale', recorded at {d / 'ucmod_scale.py'}, which no longer exists: put it "
        "back there, or where this process imports it from (PYTHONPATH)"
    ], export.stderr
