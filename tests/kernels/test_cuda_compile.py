"""The CUDA sources compile, ship as package data, and define every kernel the GPU ops ask for.

Runs in the CPU suite: compiling needs ``nvcc`` but no GPU, and ``gpu_launch.py`` (which holds the
kernel tables for ``gpu.py`` and ``gpu_optim.py``) is read as text, not imported (importing it
imports CuPy).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from importlib import resources

import pytest

PACKAGE = resources.files("raysinga.kernels")
CU_FILES = sorted(p.name for p in PACKAGE.iterdir() if p.name.endswith(".cu"))
SUFFIXES = ("f32", "f64")
TABLES = "gpu_launch.py"  # the module that compiles the .cu files and names their entry points


def _literal(name: str):
    """A literal assigned at the top of ``TABLES`` (``KERNELS``: kernel file -> entry points
    without the dtype suffix; ``NVRTC_OPTIONS``: the compiler options of every file;
    ``LIBDEVICE_FMA``: kernel file -> entry points allowed fused multiply-adds)."""
    tree = ast.parse(PACKAGE.joinpath(TABLES).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{TABLES} defines no {name} table")


KERNELS = _literal("KERNELS")
OPTIONS = _literal("NVRTC_OPTIONS")
LIBDEVICE_FMA = _literal("LIBDEVICE_FMA")


def test_every_cu_file_is_used_and_shipped():
    assert CU_FILES, "no .cu files found through importlib.resources"
    assert sorted(KERNELS) == CU_FILES
    for name in CU_FILES:
        src = PACKAGE.joinpath(name).read_text()
        assert 'extern "C"' in src, name
        # NVRTC compiles these at run time without the CUDA headers.
        assert not re.search(r"^\s*#\s*include", src, re.M), f"{name} has an #include"


@pytest.mark.parametrize("filename", sorted(KERNELS))
def test_requested_kernels_are_defined(filename):
    """Entry points come from ENTRY_POINTS(T, SUF) macros, so look for ``name_##SUF``."""
    src = PACKAGE.joinpath(filename).read_text()
    assert re.search(r"ENTRY_POINTS\(float, f32\)", src) and re.search(
        r"ENTRY_POINTS\(double, f64\)", src
    )
    for name in KERNELS[filename]:
        assert re.search(rf'extern "C" __global__ void {name}_##SUF\(', src), name


def _entries(ptx: str) -> dict[str, str]:
    """Each entry point's PTX, by name."""
    parts = re.split(r"(?=\.visible\s+\.entry\s)", ptx)[1:]
    return {re.search(r"\.entry\s+(\w+)\s*\(", p).group(1): p for p in parts}


def test_every_file_is_compiled_without_contraction():
    assert "--fmad=false" in OPTIONS
    for filename, names in LIBDEVICE_FMA.items():
        assert set(names) <= set(KERNELS[filename]), filename


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])  # the oldest and newest targeted
@pytest.mark.parametrize("filename", CU_FILES)
def test_compiles_with_nvcc(filename, arch, tmp_path):
    ptx = tmp_path / "out.ptx"
    with resources.as_file(PACKAGE.joinpath(filename)) as src:
        cmd = ["nvcc", "--ptx", f"-arch={arch}", "-Werror", "all-warnings", *OPTIONS]
        run = subprocess.run([*cmd, str(src), "-o", str(ptx)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr.lower(), run.stderr
    entries = _entries(ptx.read_text())
    wanted = {f"{name}_{suf}" for name in KERNELS.get(filename, ()) for suf in SUFFIXES}
    assert wanted <= set(entries), f"missing from the PTX: {sorted(wanted - set(entries))}"
    # Rounding as NumPy's: no product contracted into an addition, except inside libdevice's
    # transcendental functions (a kernel calling exp, tanh or log is listed in LIBDEVICE_FMA).
    allowed = {f"{n}_{suf}" for n in LIBDEVICE_FMA.get(filename, ()) for suf in SUFFIXES}
    fused = sorted(n for n, body in entries.items() if n not in allowed and "fma." in body)
    assert not fused, f"fused multiply-adds in the PTX of {fused}"


def _nvrtc():
    """CuPy's NVRTC binding with its library loadable (``raysinga[gpu]`` installs both), else
    ``None``. Compiling needs no GPU and no driver."""
    try:
        from cupy.cuda import nvrtc  # noqa: PLC0415 - optional dependency

        nvrtc.getVersion()
    except Exception:
        return None
    return nvrtc


@pytest.mark.skipif(_nvrtc() is None, reason="CuPy's NVRTC is not installed (raysinga[gpu])")
@pytest.mark.parametrize("filename", CU_FILES)
def test_compiles_with_the_nvrtc_that_the_gpu_extra_installs(filename):
    """What runs on a user's machine: NVRTC, without the CUDA headers, with the options of
    ``gpu_launch.py``, for the oldest and newest architectures the project targets."""
    nvrtc = _nvrtc()
    src = PACKAGE.joinpath(filename).read_text()
    wanted = {f"{name}_{suf}" for name in KERNELS[filename] for suf in SUFFIXES}
    for arch in ("compute_80", "compute_90"):
        prog = nvrtc.createProgram(src, filename, (), ())
        try:
            options = [*OPTIONS, f"-arch={arch}"]
            try:
                nvrtc.compileProgram(prog, options)
            except nvrtc.NVRTCError as e:
                log = nvrtc.getProgramLog(prog)
                raise AssertionError(f"{filename} ({arch}): {e}\n{log}") from None
            ptx = nvrtc.getPTX(prog).decode()
        finally:
            nvrtc.destroyProgram(prog)
        entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
        assert wanted <= entries, f"missing from the PTX: {sorted(wanted - entries)}"
