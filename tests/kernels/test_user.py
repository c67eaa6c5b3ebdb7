"""kernels/user.py: a user's layer names a CUDA kernel and its NumPy twin once, and each call
runs the one its arrays ask for. On the CPU: the NumPy twin is called, a kernel without one or
whose twin returns the wrong number of arrays is refused in one line naming it and where it was
defined, and a raw kernel's source compiles with nvcc for both float types. On a GPU (``gpu``):
the kernels compile with raysinga's options and agree with their NumPy twins."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from raysinga import kernels as K
from raysinga.kernels import user

AXPY = r"""
extern "C" __global__ void axpy(const T* x, T* y, T a, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        y[i] = a * x[i] + y[i];
}
"""


def _axpy_cpu(x, y, a, n):
    y += a * x


def _gate_cpu(a, b):
    sig = 1.0 / (1.0 + np.exp(-a))
    return sig, a * sig * b


AXPY_K = K.raw_kernel(AXPY, "axpy", cpu=_axpy_cpu)
GATE = K.elementwise_kernel(
    "T a, T b",
    "T sig, T h",
    "sig = 1 / (1 + exp(-a)); h = a * sig * b;",
    name="gate",
    cpu=_gate_cpu,
)


def test_numpy_arrays_run_the_cpu_twin():
    x, y = np.arange(4.0), np.ones(4)
    assert AXPY_K(4, x, y, 2.0, 4) is None
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]
    a, b = np.linspace(-2, 2, 5, dtype=np.float32), np.full(5, 3, np.float32)
    sig, h = GATE(a, b)
    want = _gate_cpu(a, b)
    assert sig.tobytes() == want[0].tobytes() and h.tobytes() == want[1].tobytes()
    assert h.dtype == np.float32


def test_a_kernel_without_cpu_code_is_one_line_naming_it_and_where():
    k = user.elementwise("T x", "T y", "y = x;", name="copy_only", cpu=None)
    with pytest.raises(TypeError) as e:
        k(np.zeros(3))
    line = str(e.value)
    assert "\n" not in line and "'copy_only'" in line and "test_user.py:" in line, line
    assert "no CPU code" in line and "cpu=" in line, line


def test_a_cpu_twin_returning_the_wrong_number_of_arrays_is_refused():
    k = user.elementwise("T a, T b", "T sig, T h", "sig = a; h = b;", name="two", cpu=np.add)
    with pytest.raises(TypeError, match=r"'two' .*returned 1 array, the kernel declares 2"):
        k(np.zeros(2), np.zeros(2))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: user.raw(AXPY, "not a name", cpu=_axpy_cpu), "C identifier"),
        (lambda: user.raw(AXPY, "axpy", cpu=_axpy_cpu, per="row"), "per must be"),
        (lambda: user.raw(AXPY, "axpy", cpu="axpy"), "cpu= must be a function"),
        (lambda: user.elementwise("T x", " ", "", name="k", cpu=None), "declares no output"),
    ],
)
def test_bad_definitions_are_refused_where_they_are_made(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_raw_kernels_source_compiles_for_each_float_type(dtype, tmp_path):
    from test_cuda_compile import OPTIONS  # the options every kernel of raysinga's is built with

    src = tmp_path / "axpy.cu"
    src.write_text(AXPY_K.source_for(dtype))
    cmd = ["nvcc", "--ptx", "-arch=sm_80", "-Werror", "all-warnings", *OPTIONS, str(src)]
    r = subprocess.run([*cmd, "-o", str(tmp_path / "axpy.ptx")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "axpy.ptx").read_text()
    assert ".entry axpy(" in ptx and ("f64" in ptx) == (dtype == "float64")
    assert "fma.rn" not in ptx  # --fmad=false: a * x + y rounds as NumPy rounds it


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_on_a_gpu_the_kernels_agree_with_their_numpy_twins(dtype):
    cp = K.cupy_module()
    rng = np.random.default_rng(0)
    n = 100_000  # more than one grid's worth of 256-thread blocks is not needed: grid-stride
    x, y = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    gx, gy = cp.asarray(x), cp.asarray(y)
    AXPY_K(n, gx, gy, dtype(0.5), n)
    _axpy_cpu(x, y, dtype(0.5), n)
    assert cp.asnumpy(gy).tobytes() == y.tobytes()  # no contraction: the same bits
    a, b = x[:1000], y[:1000]
    sig, h = GATE(cp.asarray(a), cp.asarray(b))
    want = _gate_cpu(a, b)
    assert sig.dtype == dtype and h.dtype == dtype
    tol = 4 * np.finfo(dtype).eps  # exp is libdevice's, not NumPy's: an ulp or two apart
    np.testing.assert_allclose(cp.asnumpy(sig), want[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(cp.asnumpy(h), want[1], rtol=8 * tol, atol=8 * tol)


@pytest.mark.gpu
def test_on_a_gpu_a_kernel_that_does_not_compile_names_itself_and_where():
    cp = K.cupy_module()
    k = user.raw("this is not CUDA", "broken", cpu=_axpy_cpu)
    with pytest.raises(
        RuntimeError, match=r"kernel 'broken' \(.*test_user.py:\d+\) did not compile"
    ):
        k(3, cp.zeros(3), cp.zeros(3), 1.0, 3)
