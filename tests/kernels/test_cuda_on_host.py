"""The CUDA kernels run on the CPU: each ``.cu`` file is compiled as host C++ (its CUDA keywords
defined away, ``-ffp-contract=off`` as NVRTC's ``--fmad=false``) and its entry points compared
with their NumPy references. An element-wise kernel runs as one thread walking its grid-stride
loop; a kernel that reduces across a block (layer and batch norm, softmax and cross-entropy)
runs each block as 256 host threads meeting at a barrier for every ``__syncthreads``, the blocks
one after another. So CI checks the GPU's arithmetic without a GPU: the bf16 casts against
``ml_dtypes``, the optimizer updates bit for bit (their scalars by value and from device memory,
as a replayed CUDA graph passes them), dropout's mask with its key in device memory, the
embedding's counting sort, the fused activation backward, and the block reductions to the GPU
parity tests' tolerance (layer norm over one feature exactly 0). The other element-wise
kernels (GELU, the recurrent cells, im2col, pooling, activations, the embedding lookup) go
through one generated call each (:func:`kernel_call`). Needs a C++ compiler (C++20 for the
blocks), no GPU."""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from raysinga.kernels import common, cpu
from raysinga.kernels import precision as P
from raysinga.optim.optimizers import make_optimizer

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")

# What every host build of a .cu file starts with: CUDA's keywords defined away, its bit casts,
# and the program's input and output (binary arrays on stdin and stdout).
COMMON = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
struct Dim { long long x; };
static unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
template <typename T> static std::vector<T> take(long long n) {
  std::vector<T> v(n > 0 ? n : 1);
  if (n > 0 && (long long)std::fread(v.data(), sizeof(T), n, stdin) != n) throw 1;
  return v;
}
template <typename T> static void give(const std::vector<T>& v, long long n) {
  std::fwrite(v.data(), sizeof(T), n, stdout);
}
"""

# One thread walks every grid-stride loop.
PRELUDE = (
    COMMON
    + r"""
static void __syncthreads() {}
static Dim blockIdx{0}, blockDim{1}, threadIdx{0}, gridDim{1};
template <class T> static T __shfl_xor_sync(unsigned, T v, int) { return v; }  // a lone lane
"""
)

# Blocks of 256 threads for the kernels that reduce across a block: each block runs as 256 host
# threads meeting at a barrier for every __syncthreads, the blocks one after another (at most 3,
# each looping over its rows, as a launch past the largest grid does).
BLOCKS = (
    "#include <barrier>\n#include <thread>\n"
    + COMMON
    + r"""
static Dim blockIdx{0}, blockDim{256}, gridDim{1};
static thread_local Dim threadIdx{0};
static std::barrier<>* block_barrier;
static void __syncthreads() { block_barrier->arrive_and_wait(); }
// A warp shuffle as every thread of the block calling it at once (as the kernels' block sums
// do): each puts its value in its slot, and takes its partner's once all are in.
alignas(8) static unsigned char shfl_slots[256 * 8];
template <class T> static T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  T* slot = reinterpret_cast<T*>(shfl_slots);
  slot[threadIdx.x] = v;
  block_barrier->arrive_and_wait();
  const T got = slot[threadIdx.x ^ lane_mask];
  block_barrier->arrive_and_wait();
  return got;
}
template <class F> static void run_blocks(long long blocks, F kernel) {
  // At most 3 blocks: each kernel's grid-stride loop takes a block through every gridDim-th row,
  // as on a GPU past its largest grid, so the rows beyond are covered by the same code.
  gridDim.x = blocks < 3 ? blocks : 3;
  for (long long b = 0; b < gridDim.x; ++b) {
    blockIdx.x = b;
    std::barrier<> bar(256);
    block_barrier = &bar;
    std::vector<std::thread> threads;
    for (long long t = 0; t < 256; ++t)
      threads.emplace_back([t, &kernel] { threadIdx.x = t; kernel(); });
    for (auto& th : threads) th.join();
  }
}
"""
)


class Host:
    """A ``.cu`` file built as a host program whose ``main`` is given (``blocks``: with real
    blocks of threads, :data:`BLOCKS`)."""

    def __init__(self, d: Path, filename: str, main: str, blocks: bool = False) -> None:
        prelude = BLOCKS if blocks else PRELUDE
        (d / f"{filename}.cpp").write_text(prelude + f"#include KERNEL\nint main() {{\n{main}\n}}")
        src = resources.files("raysinga.kernels").joinpath(filename)
        self.exe = d / filename.replace(".cu", "")
        std = "-std=c++20" if blocks else "-std=c++14"
        with resources.as_file(src) as cu:
            cmd = [CXX, "-O0", std, "-pthread", "-ffp-contract=off", f'-DKERNEL="{cu}"']
            run = subprocess.run(
                [*cmd, str(d / f"{filename}.cpp"), "-o", str(self.exe)],
                capture_output=True,
                text=True,
            )
        assert run.returncode == 0, run.stderr

    def __call__(self, *inputs: np.ndarray) -> bytes:
        data = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs)
        out = subprocess.run([str(self.exe)], input=data, capture_output=True)
        assert out.returncode == 0, out.stderr
        return out.stdout


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(filename, main, blocks=False)``: a :class:`Host`, compiled once per module for
    each distinct program (the parametrized cases share theirs)."""
    made: dict[tuple, Host] = {}

    def get(filename: str, main: str, blocks: bool = False) -> Host:
        key = (filename, main, blocks)
        if key not in made:
            made[key] = Host(tmp_path_factory.mktemp("host"), filename, main, blocks)
        return made[key]

    return get


def _i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


# --- bf16 casts -----------------------------------------------------------------------------


def test_the_bf16_casts_round_as_ml_dtypes(build):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    host = build(
        "precision.cu",
        """long long n = take<long long>(1)[0];
        auto x = take<float>(n); std::vector<unsigned short> y(n); std::vector<float> b(n);
        to_bf16_f32(x.data(), y.data(), n); from_bf16_f32(y.data(), b.data(), n);
        give(y, n); give(b, n); return 0;""",
    )
    rng = np.random.default_rng(1)
    base = np.arange(0x3F800, 0x3FFFF, dtype=np.uint32)
    x = np.concatenate(
        [
            rng.standard_normal(50_000).astype(np.float32) * np.float32(100),
            rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
            (base << 16 | np.uint32(0x8000)).view(np.float32),  # exact ties
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-40], np.float32),
        ]
    )
    out = host(_i64(x.size), x)
    words = np.frombuffer(out[: 2 * x.size], np.uint16)
    back = np.frombuffer(out[2 * x.size :], np.float32)
    nan = np.isnan(x)
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(words[~nan], want[~nan])
    assert np.array_equal(words, P.bf16_bits(x))  # NaN too: the same quiet word
    assert np.array_equal(back[~nan], P.round_bf16(x)[~nan]) and np.isnan(back[nan]).all()


# --- the optimizer updates ------------------------------------------------------------------

OPTIM_MAIN = """
auto head = take<long long>(3);
long long n = head[0], kind = head[1], from_memory = head[2];
auto p = take<float>(n); auto g = take<float>(n); auto a = take<float>(n); auto b = take<float>(n);
auto s = take<double>(16);  // the scalars, as the wrapper rounds them (T) or passes them (double)
auto f = [&](int i) { return (float)s[i]; };
const double* step = from_memory ? s.data() + 10 : nullptr;
std::vector<unsigned short> copy(n);  // the bf16 copy, written when from_memory is 1
unsigned short* c = from_memory ? copy.data() : nullptr;
if (kind == 0)
  sgd_update_f32(p.data(), g.data(), a.data(), n, from_memory ? 0.f : f(0), f(1), f(2),
                 (long long)s[3], (long long)s[4], step, c);
else
  adam_update_f32(p.data(), g.data(), a.data(), b.data(), n, from_memory ? 0.f : f(0),
                  (long long)s[1], f(2), f(3), f(4), (long long)s[5], f(6), f(7),
                  from_memory ? 0.f : f(8), from_memory ? 0.f : f(9), f(15), step, c);
give(p, n); give(a, n); give(b, n); give(copy, n); return 0;
"""


@pytest.fixture(scope="module")
def optim(tmp_path_factory):
    return Host(tmp_path_factory.mktemp("optim"), "optim.cu", OPTIM_MAIN)


@pytest.mark.parametrize("from_memory", [False, True])
@pytest.mark.parametrize(
    "spec",
    [
        {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
        {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
        {"name": "adam", "lr": 0.01, "weight_decay": 0.001},
        {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
    ],
)
def test_the_fused_updates_are_numpys_bit_for_bit(optim, spec, from_memory):
    """Five steps of each, the scalars by value or (a replayed graph's way) from memory; with
    them from memory the kernel also writes the parameter's bf16 copy, which must be its
    rounding to nearest even (what a cast of the weight would give)."""
    rng = np.random.default_rng(2)
    n = 1000
    ref, opt = make_optimizer(spec), make_optimizer(spec)
    p_ref = rng.standard_normal(n).astype(np.float32)
    p, a, b = p_ref.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    h = opt.hparams
    for step in range(5):
        g = rng.standard_normal(n).astype(np.float32)
        ref.update(step, "w", p_ref, g)
        lr, t = opt.lr(step), step + 1
        s = np.zeros(16)
        if spec["name"] == "sgd":
            kind = 0
            s[:5] = lr, h["momentum"], h["weight_decay"], 1, h["nesterov"]
        else:
            kind = 1
            beta1, beta2 = h["betas"]
            decay, neg_step, bc2 = common.adam_step_values(lr, t, h["betas"], h["weight_decay"])
            w = 1 - beta1
            decoupled = bool(h["weight_decay"]) and spec["name"] == "adamw"
            s[:10] = (
                decay,
                decoupled,
                h["weight_decay"],
                w,
                1.0 - w,
                abs(w) >= 0.5,
                beta2,
                (1 - beta2),
                neg_step,
                bc2,
            )
            s[15] = h["eps"]
        s[10:13] = opt._step_values(lr, t) + (0.0,) * (3 - len(opt._step_values(lr, t)))
        out = optim(_i64(n, kind, int(from_memory)), p, g, a, b, s)
        p = np.frombuffer(out[: 4 * n], np.float32).copy()
        a = np.frombuffer(out[4 * n : 8 * n], np.float32).copy()
        b = np.frombuffer(out[8 * n : 12 * n], np.float32).copy()
        copy = np.frombuffer(out[12 * n :], np.uint16)
        assert p.tobytes() == p_ref.tobytes(), step
        if from_memory:
            assert np.array_equal(copy, P.bf16_bits(p_ref)), step  # (checked against ml_dtypes)
        else:
            assert not copy.any()  # no copy asked for: none written
    slots = ref._slots["w"]
    assert a.tobytes() == slots["momentum" if kind == 0 else "m"].tobytes()


# --- dropout, the embedding's counting sort, the fused activation backward ------------------


def test_dropout_with_its_key_in_memory_draws_the_cpu_mask(build):
    host = build(
        "dropout.cu",
        """long long n = take<long long>(1)[0]; auto ko = take<unsigned long long>(3);
        std::vector<float> out(n);
        dropout_mask_f32(out.data(), n, 0, 0, ko[2], 2.0f, ko.data(), 12);
        give(out, n); return 0;""",
    )
    x = np.zeros((5, 12), np.float32)
    key, offset = common.dropout_key(7, 3, "drop"), 40
    want = cpu.dropout_mask(x, 0.5, key, offset)
    thresh = common.dropout_threshold(0.5)
    out = host(_i64(x.size), np.array([key, offset, thresh], np.uint64))
    assert np.array_equal(np.frombuffer(out, np.float32).reshape(x.shape), want)


def test_the_embeddings_rows_are_grouped_by_a_stable_counting_sort(build):
    host = build(
        "seq.cu",
        """auto head = take<long long>(3);
        long long m = head[0], v = head[1], d = head[2];
        auto idx = take<long long>(m); auto dy = take<float>(m * d);
        std::vector<long long> counts(v), starts(v + 1, 0), order(m); std::vector<float> dw(v * d);
        emb_count_f32(idx.data(), counts.data(), m, v);
        for (long long i = 0; i < v; ++i) starts[i + 1] = starts[i] + counts[i];
        emb_order_f32(idx.data(), starts.data(), order.data(), m, v);
        emb_bwd_f32(order.data(), starts.data(), dy.data(), dw.data(), v, d);
        give(order, m); give(starts, v + 1); give(dw, v * d); return 0;""",
    )
    rng = np.random.default_rng(3)
    m, v, d = 300, 17, 5
    idx = rng.integers(0, v - 2, m).astype(np.int64)  # the last two ids unused
    dy = rng.standard_normal((m, d)).astype(np.float32)
    out = host(_i64(m, v, d), idx, dy)
    order = np.frombuffer(out[: 8 * m], np.int64)
    starts = np.frombuffer(out[8 * m : 8 * (2 * m + v + 1) - 8 * m], np.int64)
    dw = np.frombuffer(out[8 * (m + v + 1) :], np.float32).reshape(v, d)
    assert np.array_equal(order, np.argsort(idx, kind="stable"))
    assert np.array_equal(starts, np.searchsorted(idx[order], np.arange(v + 1)))
    want = np.zeros((v, d), np.float32)
    for r in range(m):  # each token's rows added in row order, in float32
        want[idx[r]] += dy[r]
    assert np.array_equal(dw, want)


@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh", "linear"])
def test_the_fused_activation_backward_sums_the_bias_gradient_as_col_sum(build, act):
    host = build(
        "activation.cu",
        """long long m = take<long long>(1)[0], f = take<long long>(1)[0],
        rows = take<long long>(1)[0], act = take<long long>(1)[0];
        auto dy = take<float>(m * f); auto y = take<float>(m * f);
        long long chunks = (m + rows - 1) / rows;
        std::vector<float> dz(m * f), part(chunks * f), dz2(m * f), part2(chunks * f);
        act_bwd_col_sum_f32(dy.data(), y.data(), dz.data(), part.data(), m, f, rows, act);
        act_bwd_f32(dy.data(), y.data(), dz2.data(), m * f, act);
        col_sum_f32(dz2.data(), part2.data(), m, f, rows);
        give(dz, m * f); give(part, chunks * f); give(dz2, m * f); give(part2, chunks * f);
        return 0;""",
    )
    rng = np.random.default_rng(4)
    m, f, rows = 600, 7, 256
    dy = rng.standard_normal((m, f)).astype(np.float32)
    y = cpu.activation_forward(rng.standard_normal((m, f)).astype(np.float32), act)
    code = common.ACTIVATIONS.index(act)
    out = host(_i64(m, f, rows, code), dy, y)
    k = -(-m // rows)
    sizes = [m * f, k * f, m * f, k * f]
    parts = np.split(np.frombuffer(out, np.float32), np.cumsum(sizes)[:-1])
    dz, part, dz2, part2 = parts
    assert np.array_equal(dz, dz2) and np.array_equal(part, part2)  # the two kernels' bits
    assert np.array_equal(dz.reshape(m, f), cpu.activation_backward(dy, y, act))


@pytest.mark.parametrize(("m", "f"), [(1, 1), (3, 7), (5, 700), (4, 2048), (4, 2500)])
def test_layer_norm_over_blocks_of_threads_matches_numpy_and_cancels_exactly(build, m, f):
    """Forward and backward, with gamma's and beta's gradients summed from the blocks' partial
    sums, against NumPy; rows kept in registers (up to 2048 features) and rows read again
    (2500). The kernels once failed a GPU test over one feature: with no product contracted
    into the subtraction, ``dy*gamma - mean(dy*gamma)`` is exactly 0 there, so dx is too."""
    from raysinga.kernels import cpu_seq

    host = build(
        "seq.cu",
        """auto head = take<long long>(2); long long m = head[0], f = head[1];
        auto x = take<float>(m * f); auto g = take<float>(f); auto b = take<float>(f);
        auto dy = take<float>(m * f);
        long long grid = m < 3 ? m : 3;  // the blocks run_blocks makes
        std::vector<float> y(m * f), mean(m), rstd(m), dx(m * f), part(grid * 2 * f);
        std::vector<float> dg(f), db(f);
        run_blocks(m, [&] { ln_fwd_f32(x.data(), g.data(), b.data(), y.data(), mean.data(),
                                       rstd.data(), m, f, 1e-5f); });
        run_blocks(m, [&] { ln_bwd_f32(dy.data(), x.data(), g.data(), mean.data(), rstd.data(),
                                       dx.data(), part.data(), m, f); });
        for (long long p = 0; p < grid; ++p)
          for (long long j = 0; j < f; ++j) {
            dg[j] += part[(p * 2) * f + j];
            db[j] += part[(p * 2 + 1) * f + j];
          }
        give(y, m * f); give(mean, m); give(rstd, m); give(dx, m * f); give(dg, f);
        give(db, f); return 0;""",
        blocks=True,
    )
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((m, f)) * 3).astype(np.float32)
    g, b = (rng.standard_normal(f).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal((m, f)).astype(np.float32)
    out = host(_i64(m, f), x, g, b, dy)
    assert out == host(_i64(m, f), x, g, b, dy)  # the same bits again
    y, mean, rstd, dx, dg, db = np.split(
        np.frombuffer(out, np.float32), np.cumsum([m * f, m, m, m * f, f])
    )
    want_y, want_mean, want_rstd = cpu_seq.layernorm_forward(x, g, b, 1e-5)
    want_dx, want_dg, want_db = cpu_seq.layernorm_backward(dy, x, g, want_mean, want_rstd)
    pairs = ((y, want_y), (mean, want_mean), (rstd, want_rstd), (dx, want_dx), (dg, want_dg),
             (db, want_db))  # fmt: skip
    for got, want in pairs:
        scale = float(np.abs(want).max(initial=0.0)) or 1.0
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=1e-5 * scale)
    if f == 1:
        assert not dx.any(), dx  # exactly 0: one feature is its own mean


@pytest.mark.parametrize(("m", "f"), [(1, 1), (3, 7), (5, 700), (4, 2500)])
def test_rms_norm_over_blocks_of_threads_matches_numpy(build, m, f):
    """RMS norm forward and backward, gamma's gradient summed from the blocks' partial rows,
    against NumPy, for rows kept in registers and rows read again (2500 features)."""
    from raysinga.kernels import cpu_seq

    host = build(
        "seq.cu",
        """auto head = take<long long>(2); long long m = head[0], f = head[1];
        auto x = take<float>(m * f); auto g = take<float>(f); auto dy = take<float>(m * f);
        long long grid = m < 3 ? m : 3;  // the blocks run_blocks makes
        std::vector<float> y(m * f), rstd(m), dx(m * f), part(grid * f), dg(f);
        run_blocks(m, [&] { rms_fwd_f32(x.data(), g.data(), y.data(), rstd.data(), m, f,
                                        1e-6f); });
        run_blocks(m, [&] { rms_bwd_f32(dy.data(), x.data(), g.data(), rstd.data(), dx.data(),
                                        part.data(), m, f); });
        for (long long p = 0; p < grid; ++p)
          for (long long j = 0; j < f; ++j) dg[j] += part[p * f + j];
        give(y, m * f); give(rstd, m); give(dx, m * f); give(dg, f); return 0;""",
        blocks=True,
    )
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((m, f)) * 3).astype(np.float32)
    g = rng.standard_normal(f).astype(np.float32)
    dy = rng.standard_normal((m, f)).astype(np.float32)
    out = host(_i64(m, f), x, g, dy)
    assert out == host(_i64(m, f), x, g, dy)  # the same bits again
    y, rstd, dx, dg = np.split(np.frombuffer(out, np.float32), np.cumsum([m * f, m, m * f]))
    want_y, want_rstd = cpu_seq.rmsnorm_forward(x, g, 1e-6)
    want_dx, want_dg = cpu_seq.rmsnorm_backward(dy, x, g, want_rstd)
    for got, want in ((y, want_y), (rstd, want_rstd), (dx, want_dx), (dg, want_dg)):
        scale = float(np.abs(want).max(initial=0.0)) or 1.0
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=1e-5 * scale)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    """As the GPU parity tests compare (kernels/test_gpu_parity.py): to 1e-5 of the largest."""
    scale = float(np.abs(want).max(initial=0.0)) or 1.0
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize(("n", "c"), [(1, 1), (7, 10), (33, 300)])
def test_softmax_cross_entropy_over_blocks_matches_numpy(build, n, c):
    host = build(
        "softmax_xent.cu",
        """auto head = take<long long>(2); long long n = head[0], c = head[1];
        auto logits = take<float>(n * c); auto labels = take<long long>(n);
        std::vector<float> probs(n * c), row(n), d(n * c);
        run_blocks(n, [&] { xent_fwd_f32(logits.data(), labels.data(), probs.data(), row.data(),
                                         n, c); });
        blockIdx.x = 0; gridDim.x = 1;
        threadIdx.x = 0;  // the element-wise backward: one thread walks it here
        blockDim.x = 1;
        xent_bwd_f32(probs.data(), labels.data(), d.data(), n, c, 4.0f);
        std::vector<float> fused(n * c), fused_row(n);
        blockDim.x = 256;
        run_blocks(n, [&] { xent_grad_f32(logits.data(), labels.data(), fused.data(),
                                          fused_row.data(), n, c, 4.0f); });
        give(probs, n * c); give(row, n); give(d, n * c); give(fused, n * c);
        give(fused_row, n); return 0;""",
        blocks=True,
    )
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((n, c)) * 4).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int64)
    out = np.frombuffer(host(_i64(n, c), logits, labels), np.float32)
    probs, row, d, fused, fused_row = np.split(out, np.cumsum([n * c, n, n * c, n * c]))
    loss, want_probs = cpu.softmax_xent_forward(logits, labels, 1.0)
    _close(probs, want_probs)
    np.testing.assert_allclose(row.sum(dtype=np.float64), float(loss), rtol=1e-5)
    _close(d, cpu.softmax_xent_backward(want_probs, labels, 4.0))
    # loss and gradient in one kernel (xent_grad): the bits of the two kernels it replaces
    assert np.array_equal(fused, d) and np.array_equal(fused_row, row)


def test_a_label_out_of_range_gives_a_nan_loss_and_reads_nothing_outside_the_row(build):
    """The GPU does not read the labels back to check them: the kernel itself must not index
    outside a row with a bad label, and says so by a NaN loss (the row before or after would
    give a finite one)."""
    host = build(
        "softmax_xent.cu",
        """auto head = take<long long>(2); long long n = head[0], c = head[1];
        auto logits = take<float>(n * c); auto labels = take<long long>(n);
        std::vector<float> probs(n * c), row(n);
        run_blocks(n, [&] { xent_fwd_f32(logits.data(), labels.data(), probs.data(), row.data(),
                                         n, c); });
        give(row, n); return 0;""",
        blocks=True,
    )
    n, c = 4, 3
    logits = np.arange(n * c, dtype=np.float32).reshape(n, c) / 7
    labels = np.array([0, -1, 3, 1 << 40], np.int64)
    row = np.frombuffer(host(_i64(n, c), logits, labels), np.float32)
    assert np.isfinite(row[0]) and np.isnan(row[1:]).all(), row


@pytest.mark.parametrize("shape", [(1, 1), (16, 5), (4, 3, 5, 5)])
def test_batch_norm_over_blocks_matches_numpy(build, shape):
    host = build(
        "batchnorm.cu",
        """auto head = take<long long>(3); long long n = head[0], c = head[1], s = head[2];
        long long size = n * c * s, m = n * s;
        auto x = take<float>(size); auto g = take<float>(c); auto b = take<float>(c);
        auto dy = take<float>(size);
        std::vector<float> mean(c), var(c), inv(c), y(size), dg(c), db(c), k(c), dx(size);
        run_blocks(c, [&] { bn_stats_f32(x.data(), mean.data(), var.data(), inv.data(), n, c, s,
                                         1e-5f); });
        run_blocks(c, [&] { bn_bwd_reduce_f32(dy.data(), x.data(), mean.data(), inv.data(),
                                              dg.data(), db.data(), n, c, s); });
        for (long long i = 0; i < c; ++i) k[i] = g[i] * inv[i] / (float)m;
        blockIdx.x = 0; gridDim.x = 1; threadIdx.x = 0; blockDim.x = 1;
        bn_apply_f32(x.data(), mean.data(), inv.data(), g.data(), b.data(), y.data(), size, c, s);
        bn_bwd_dx_f32(dy.data(), x.data(), mean.data(), inv.data(), k.data(), dg.data(), db.data(),
                      dx.data(), size, c, s, (float)m);
        give(mean, c); give(var, c); give(inv, c); give(y, size); give(dg, c); give(db, c);
        give(dx, size); return 0;""",
        blocks=True,
    )
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    c = shape[1]
    g, b = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal(shape).astype(np.float32)
    n, s = shape[0], int(np.prod(shape[2:]))
    out = np.frombuffer(host(_i64(n, c, s), x, g, b, dy), np.float32)
    mean, var, inv, y, dg, db, dx = np.split(out, np.cumsum([c, c, c, x.size, c, c]))
    want_y, want_mean, want_var, want_inv = cpu.batchnorm_forward_train(x, g, b, 1e-5)
    want_dx, want_dg, want_db = cpu.batchnorm_backward(dy, x, g, want_mean, want_inv)
    for got, want in (
        (mean, want_mean), (var, want_var), (inv, want_inv), (y, want_y),
        (dg, want_dg), (db, want_db), (dx, want_dx),
    ):  # fmt: skip
        _close(got, want)


@pytest.mark.parametrize(("b", "t"), [(1, 1), (3, 5), (1, 260)])  # t > 256: a row over threads
def test_causal_softmax_over_blocks_matches_numpy(build, b, t):
    from raysinga.kernels import cpu_seq

    host = build(
        "seq.cu",
        """auto head = take<long long>(2); long long b = head[0], t = head[1], rows = b * t;
        auto s = take<float>(rows * t); auto dp = take<float>(rows * t);
        std::vector<float> p(rows * t), ds(rows * t);
        run_blocks(rows, [&] { csoftmax_fwd_f32(s.data(), p.data(), rows, t, 0.5f); });
        run_blocks(rows, [&] { csoftmax_bwd_f32(dp.data(), p.data(), ds.data(), rows, t, 0.5f); });
        give(p, rows * t); give(ds, rows * t); return 0;""",
        blocks=True,
    )
    rng = np.random.default_rng(8)
    scores = (rng.standard_normal((b, t, t)) * 4).astype(np.float32)
    dp = rng.standard_normal((b, t, t)).astype(np.float32)
    p, ds = np.split(np.frombuffer(host(_i64(b, t), scores, dp), np.float32), 2)
    want_p = cpu_seq.causal_softmax_forward(scores, 0.5)
    _close(p, want_p)
    _close(ds, cpu_seq.causal_softmax_backward(dp, want_p, 0.5))


# --- the other element-wise kernels, through one generated call ------------------------------

CTYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
    np.dtype(np.int64): "long long",
    np.dtype(np.int32): "int",
    np.dtype(np.uint64): "unsigned long long",
}


def kernel_call(build, filename: str, entry: str, *args) -> list[np.ndarray]:
    """Call ``entry`` of ``filename`` once (one thread walks its grid-stride loop). ``args``, in
    the kernel's order: an array (an input), ``("out", dtype, shape)`` (an output, returned in
    order), or a scalar (``np.float32``/``np.int64``... as the wrapper passes it)."""
    lines, params, outs, feed = [], [], [], []
    for i, a in enumerate(args):
        if isinstance(a, tuple) and a[0] == "out":
            dt, shape = np.dtype(a[1]), a[2]
            lines.append(f"std::vector<{CTYPES[dt]}> a{i}({int(np.prod(shape))});")
            params.append(f"a{i}.data()")
            outs.append((i, dt, shape))
        elif isinstance(a, np.ndarray) and a.ndim > 0:
            lines.append(f"auto a{i} = take<{CTYPES[a.dtype]}>({a.size});")
            params.append(f"a{i}.data()")
            feed.append(a)
        else:
            a = np.asarray(a)
            lines.append(f"{CTYPES[a.dtype]} a{i} = take<{CTYPES[a.dtype]}>(1)[0];")
            params.append(f"a{i}")
            feed.append(a.reshape(1))
    lines.append(f"{entry}({', '.join(params)});")
    lines += [f"give(a{i}, {int(np.prod(shape))});" for i, _, shape in outs]
    host = build(filename, "\n".join([*lines, "return 0;"]))
    raw, got = host(*feed), []
    for _, dt, shape in outs:
        n = int(np.prod(shape)) * dt.itemsize
        got.append(np.frombuffer(raw[:n], dt).reshape(shape))
        raw = raw[n:]
    return got


def _f32(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def test_gelu_and_the_recurrent_cells_match_numpy(build):
    from raysinga.kernels import cpu_seq

    rng = np.random.default_rng(9)
    x, dy = _f32(rng, 6, 33, scale=3.0), _f32(rng, 6, 33)
    y, t = kernel_call(build, "seq.cu", "gelu_fwd_f32", x, ("out", np.float32, x.shape),
                       ("out", np.float32, x.shape), np.int64(x.size))  # fmt: skip
    want_y, want_t = cpu_seq.gelu_forward(x)
    _close(y, want_y)
    _close(t, want_t)
    (dx,) = kernel_call(build, "seq.cu", "gelu_bwd_f32", dy, x, want_t,
                        ("out", np.float32, x.shape), np.int64(x.size))  # fmt: skip
    _close(dx, cpu_seq.gelu_backward(dy, x, want_t))

    n, u = 4, 9
    gx, gh, h = _f32(rng, n, 3 * u), _f32(rng, n, 3 * u), _f32(rng, n, u)
    h_new, gates = kernel_call(build, "seq.cu", "gru_fwd_f32", gx, gh, h,
                               ("out", np.float32, (n, u)), ("out", np.float32, (n, 4 * u)),
                               np.int64(n), np.int64(u))  # fmt: skip
    want_h, want_gates = cpu_seq.gru_cell_forward(gx, gh, h)
    _close(h_new, want_h)
    _close(gates, want_gates)
    dh_new = _f32(rng, n, u)
    got = kernel_call(build, "seq.cu", "gru_bwd_f32", dh_new, want_gates, h,
                      ("out", np.float32, (n, 3 * u)), ("out", np.float32, (n, 3 * u)),
                      ("out", np.float32, (n, u)), np.int64(n), np.int64(u))  # fmt: skip
    for a, w in zip(got, cpu_seq.gru_cell_backward(dh_new, want_gates, h), strict=True):
        _close(a, w)

    g, c = _f32(rng, n, 4 * u), _f32(rng, n, u)
    got = kernel_call(build, "seq.cu", "lstm_fwd_f32", g, c, ("out", np.float32, (n, u)),
                      ("out", np.float32, (n, u)), ("out", np.float32, (n, 4 * u)),
                      np.int64(n), np.int64(u))  # fmt: skip
    want = cpu_seq.lstm_cell_forward(g, c)
    for a, w in zip(got, want, strict=True):
        _close(a, w)
    _, c_new, acts = want
    dh, dc = _f32(rng, n, u), _f32(rng, n, u)
    got = kernel_call(build, "seq.cu", "lstm_bwd_f32", dh, dc, acts, c, c_new,
                      ("out", np.float32, (n, 4 * u)), ("out", np.float32, (n, u)),
                      np.int64(n), np.int64(u))  # fmt: skip
    for a, w in zip(got, cpu_seq.lstm_cell_backward(dh, dc, acts, c, c_new), strict=True):
        _close(a, w)


@pytest.mark.parametrize(("k", "stride", "pad"), [(2, 2, 0), (3, 1, 1), (3, 2, 1)])
def test_im2col_and_pooling_match_numpy(build, k, stride, pad):
    rng = np.random.default_rng(10)
    n, c, h, w = 2, 3, 7, 6
    x = _f32(rng, n, c, h, w)
    oh, ow = common.conv_out_size(h, k, stride, pad), common.conv_out_size(w, k, stride, pad)
    geo = [np.int64(v) for v in (n, c, h, w, k, k, stride, pad, oh, ow)]
    (cols,) = kernel_call(build, "im2col.cu", "im2col_f32", x,
                          ("out", np.float32, (n * oh * ow, c * k * k)), *geo)  # fmt: skip
    want_cols = cpu.im2col(x, k, k, stride, pad)
    assert np.array_equal(cols, want_cols)
    (back,) = kernel_call(build, "im2col.cu", "col2im_f32", want_cols,
                          ("out", np.float32, x.shape), *geo)  # fmt: skip
    _close(back, cpu.col2im(want_cols, x.shape, k, k, stride, pad))

    pool = [np.int64(v) for v in (n * c, h, w, k, stride, pad, oh, ow)]
    y, arg = kernel_call(build, "pool.cu", "maxpool_fwd_f32", x,
                         ("out", np.float32, (n, c, oh, ow)), ("out", np.int32, (n, c, oh, ow)),
                         *pool)  # fmt: skip
    want_y, want_arg = cpu.maxpool_forward(x, k, stride, pad)
    assert np.array_equal(y, want_y) and np.array_equal(arg, want_arg)
    dy = _f32(rng, n, c, oh, ow)
    (dx,) = kernel_call(build, "pool.cu", "maxpool_bwd_f32", dy, want_arg,
                        ("out", np.float32, x.shape), *pool)  # fmt: skip
    _close(dx, cpu.maxpool_backward(dy, want_arg, x.shape, k, stride, pad))
    (ya,) = kernel_call(build, "pool.cu", "avgpool_fwd_f32", x,
                        ("out", np.float32, (n, c, oh, ow)), *pool)  # fmt: skip
    _close(ya, cpu.avgpool_forward(x, k, stride, pad))
    (dxa,) = kernel_call(build, "pool.cu", "avgpool_bwd_f32", dy,
                         ("out", np.float32, x.shape), *pool)  # fmt: skip
    _close(dxa, cpu.avgpool_backward(dy, x.shape, k, stride, pad))


@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh", "linear"])
def test_activations_and_the_embedding_lookup_match_numpy(build, act):
    rng = np.random.default_rng(11)
    z, b = _f32(rng, 5, 8, scale=3.0), _f32(rng, 8)
    code = np.int64(common.ACTIVATIONS.index(act))
    (y,) = kernel_call(build, "activation.cu", "act_fwd_f32", z, ("out", np.float32, z.shape),
                       np.int64(z.size), code)  # fmt: skip
    _close(y, cpu.activation_forward(z, act))
    out = ("out", np.float32, z.shape)
    (yb,) = kernel_call(
        build, "activation.cu", "bias_act_fwd_f32", z, b, out, np.int64(z.size), np.int64(8), code
    )
    _close(yb, cpu.bias_act_forward(z, b, act))
    idx, table = rng.integers(0, 11, 13).astype(np.int64), _f32(rng, 11, 4)
    (rows,) = kernel_call(build, "seq.cu", "emb_fwd_f32", idx, table,
                          ("out", np.float32, (13, 4)), np.int64(13), np.int64(4))  # fmt: skip
    assert np.array_equal(rows, table[idx])
