"""The device choice: a GPU is taken only after it computed correctly, an automatic choice that
falls back to the CPU says why in one line, and ``RAYSINGA_DEVICE=gpu`` fails at once.

No GPU is needed: each case runs a fresh Python whose ``cupy`` is a stand-in, importable from a
temporary directory, that fails at one step of the probe the way a real installation does (the
wheel's libraries missing, a driver too old for the wheel, NVRTC unable to compile, a wrong
result, cuBLAS failing). A real CuPy without a usable GPU is tried as well where one is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = """
import os

import numpy as np

MODE = os.environ["STAND_IN_CUPY"]
if MODE == "import":
    raise ImportError("libnvrtc.so.12: cannot open shared object file: No such file or directory")
float32 = np.float32


class CUDARuntimeError(RuntimeError):
    pass


class _Runtime:
    @staticmethod
    def getDeviceCount():
        if MODE == "runtime":
            raise CUDARuntimeError("cudaErrorInsufficientDriver: driver version is insufficient")
        return 0 if MODE == "none" else 1


class cuda:
    runtime = _Runtime


class CompileException(Exception):
    pass


class RawKernel:
    def __init__(self, source, name):
        if MODE == "compile":
            raise CompileException("nvrtc: error: invalid value for --gpu-architecture (-arch)")
        assert name in source

    def __call__(self, grid, block, args):
        x, y, n = args
        y[:n] = 2 * x[:n] + (2 if MODE == "wrong" else 1)


class _Matrix(np.ndarray):
    def __matmul__(self, other):
        if MODE == "cublas":
            raise RuntimeError("CUBLAS_STATUS_NOT_INITIALIZED")
        return np.asarray(self) @ np.asarray(other)


def full(shape, value, dtype):
    return np.full(shape, value, dtype).view(_Matrix)


arange, empty_like, asnumpy = np.arange, np.empty_like, np.asarray
"""

PROBE = textwrap.dedent(
    """
    from raysinga.kernels import backend as b
    try:
        print("device:", b.device())
    except RuntimeError as e:
        print("error:", e)
    print("note:", b.gpu_fallback_note())
    """
)


def _python(code: str, mode: str | None, tmp_path: Path, device: str | None = None, **kw):
    env = dict(os.environ)
    env.pop("RAYSINGA_DEVICE", None)
    if device is not None:
        env["RAYSINGA_DEVICE"] = device
    if mode is not None:
        (tmp_path / "cupy.py").write_text(STAND_IN)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
        env["STAND_IN_CUPY"] = mode
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, **kw
    )


def _fields(out: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


REASONS = {
    "import": "CuPy cannot be imported (ImportError: libnvrtc.so.12",
    "none": "CUDA reports no device",
    "runtime": "the CUDA runtime found no usable device (CUDARuntimeError: "
    "cudaErrorInsufficientDriver",
    "compile": "a test CUDA kernel did not compile or run (CompileException: nvrtc: error",
    "wrong": "a test CUDA kernel ran but returned wrong values",
    "cublas": "cuBLAS failed a test product (RuntimeError: CUBLAS_STATUS_NOT_INITIALIZED)",
}


@pytest.mark.parametrize("mode", sorted(REASONS))
def test_an_unusable_gpu_is_refused_with_the_step_that_failed(mode, tmp_path):
    run = _python(PROBE, mode, tmp_path)
    assert run.returncode == 0, run.stderr
    got = _fields(run.stdout)
    assert got["device"] == "cpu"
    if mode == "import":  # CuPy absent: a CPU machine, nothing to say (unless a driver is here)
        assert got["note"] == "None" or "NVIDIA driver is present" in got["note"]
    else:
        assert got["note"].startswith("raysinga: computing on the CPU: CuPy is installed")
        assert REASONS[mode] in got["note"]
    forced = _fields(_python(PROBE, mode, tmp_path, device="gpu").stdout)
    assert forced["error"].startswith("RAYSINGA_DEVICE=gpu but no GPU is usable: " + REASONS[mode])
    assert "pip install 'raysinga[gpu]'" in forced["error"]


def test_a_gpu_that_computes_correctly_is_taken(tmp_path):
    got = _fields(_python(PROBE, "ok", tmp_path).stdout)
    assert got == {"device": "gpu", "note": "None"}
    assert _fields(_python(PROBE, "ok", tmp_path, device="cpu").stdout)["device"] == "cpu"


def test_a_real_cupy_without_a_usable_gpu_falls_back_with_its_reason(tmp_path):
    pytest.importorskip("cupy")
    from raysinga import kernels  # noqa: PLC0415

    if kernels.gpu_available():
        pytest.skip("a GPU is usable here")
    got = _fields(_python(PROBE, None, tmp_path).stdout)
    assert got["device"] == "cpu"
    assert got["note"].startswith("raysinga: computing on the CPU: CuPy is installed")
    assert kernels.gpu_unavailable_reason() in got["note"]


def _train(tmp_path: Path, mode: str, device: str | None):
    cmd = [
        sys.executable,
        "-m",
        "raysinga.cli",
        "train",
        str(ROOT / "examples" / "digits_mlp.yaml"),
        "--local",
        "--set",
        "train_steps=3",
        "--set",
        f"run_dir={tmp_path / 'run'}",
    ]
    code = f"import sys; sys.argv = {cmd[2:]!r}; from raysinga.cli import program; program()"
    return _python(code, mode, tmp_path, device=device, cwd=tmp_path)


def test_a_run_says_in_one_line_why_it_took_the_cpu(tmp_path):
    run = _train(tmp_path, "compile", None)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [x for x in (run.stdout + run.stderr).splitlines() if "computing on the CPU" in x]
    assert len(lines) == 1, run.stdout + run.stderr
    assert REASONS["compile"] in lines[0]


def test_raysinga_device_gpu_fails_before_anything_is_written(tmp_path):
    run = _train(tmp_path, "compile", "gpu")
    assert run.returncode != 0
    assert "RAYSINGA_DEVICE=gpu but no GPU is usable: " + REASONS["compile"] in run.stderr
    assert not (tmp_path / "run").exists()
