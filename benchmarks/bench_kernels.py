"""Memory-bound GPU kernels against a device-to-device copy, a checkpoint's device-to-host
snapshot against a plain pinned copy, and the fused attention against PyTorch's, each measured
in the same run on the same GPU.

    pip install -e '.[bench,gpu]'
    python benchmarks/bench_kernels.py [--mib 256] [--repeats 20] [--json FILE]

The kernels: activations, dropout, pooling, the optimizers' updates, the sum of gradients, layer
norm forward and backward (768 features, gpt_small's) and softmax cross-entropy's loss with its
gradient (1024 classes). Each kernel's bandwidth is the bytes it must read and write (its inputs
and outputs, once) over its time, from CUDA events around each of ``--repeats`` launches after a
warm-up; the reference is ``cupy.copyto`` of an array of the same size (read once, written
once), timed the same way just before. Each launch's bandwidth over the copy's median is a
round: a kernel's figure is the median of its rounds, with their minimum and maximum. Ratios > 1
would mean a kernel moves its bytes faster than a copy. Goal: every median at least 0.8.

The snapshot is :class:`raysinga.actors.common.device.ServerDevice`'s copy of optimizer slots to
pinned host memory on its own stream; the reference is one ``ndarray.get`` of the same bytes into
pinned memory, timed in turn with it. Goal: at least 0.8x.

The fused causal attention (``kernels/attention.cu``, float32) at gpt_small's shape, batch 8, 12
heads of 64, T 256 and 1024, forward and backward against PyTorch's
``scaled_dot_product_attention(is_causal=True)`` on the same float32 values, each timed in turn
in the same run: a round is one launch's time over PyTorch's median. Goal: at most 1.0x.

``--json FILE`` writes every figure and round. Prints "not measured" where no GPU is usable.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from report import Figure, Report, add_json_option

from raysinga import kernels as K

GOAL = 0.8  # a kernel's bandwidth and the snapshot's against their plain copies, at least
ATTENTION_GOAL = 1.0  # the fused attention's time over PyTorch's, at most


def timed(cp, fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls after a warm-up, timed with CUDA events."""
    fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return times


def kernel_cases(cp, gpu, n: int, dtype) -> list[tuple[str, object, int]]:
    """(name, call, bytes read and written) per memory-bound kernel, on ``n`` elements."""
    from raysinga.kernels import gpu_optim, gpu_seq

    rng = cp.random.default_rng(0)
    item = np.dtype(dtype).itemsize
    a, b = rng.standard_normal(n, dtype=dtype), rng.standard_normal(n, dtype=dtype)
    rows = n // 1024
    z, bias = a[: rows * 1024].reshape(rows, 1024), rng.standard_normal(1024, dtype=dtype)
    p, g, m, v = (rng.standard_normal(n, dtype=dtype) for _ in range(4))
    v = cp.abs(v)
    bufs = [rng.standard_normal(n, dtype=dtype) for _ in range(4)]
    out = cp.empty(n, dtype)
    side = int((n // 64) ** 0.5) // 2 * 2
    x4 = a[: 64 * side * side].reshape(4, 16, side, side)
    pooled = 64 * (side // 2) ** 2
    # layer norm over gpt_small's 768 features; the loss over 1024 classes (rows of logits)
    feats, classes = 768, 1024
    xr = a[: n // feats * feats].reshape(-1, feats)
    dyr, gamma, beta = b[: xr.size].reshape(xr.shape), bias[:feats] + 1, bias[:feats]
    _, mean, rstd = gpu_seq.layernorm_forward(xr, gamma, beta, 1e-5)
    logits = a[: n // classes * classes].reshape(-1, classes)
    labels = cp.arange(logits.shape[0], dtype=cp.int64) % classes
    return [
        ("relu forward", lambda: gpu.activation_forward(a, "relu"), 2 * n * item),
        ("relu backward", lambda: gpu.activation_backward(a, b, "relu"), 3 * n * item),
        ("bias + relu", lambda: gpu.bias_act_forward(z, bias, "relu"), 2 * z.size * item),
        ("dropout mask", lambda: gpu.dropout_mask(a, 0.5, 7, 0), n * item),
        ("max pool 2x2", lambda: gpu.maxpool_forward(x4, 2, 2, 0), x4.size * item + pooled * 8),
        ("avg pool 2x2", lambda: gpu.avgpool_forward(x4, 2, 2, 0), x4.size * item + pooled * 4),
        (
            "sgd momentum",
            lambda: gpu_optim.sgd_update(p, g, m, 1e-3, 0.9, 0.0, False),
            5 * n * item,
        ),
        (
            "adam",
            lambda: gpu_optim.adam_update(p, g, m, v, 1e-3, 10, (0.9, 0.999), 1e-8, 0.0, False),
            7 * n * item,
        ),
        ("sum of 4 grads", lambda: gpu_optim.weighted_sum(out, bufs), 5 * n * item),
        (
            "layer norm forward (768)",
            lambda: gpu_seq.layernorm_forward(xr, gamma, beta, 1e-5),
            2 * xr.size * item,
        ),
        (
            "layer norm backward (768)",
            lambda: gpu_seq.layernorm_backward(dyr, xr, gamma, mean, rstd),
            3 * xr.size * item,
        ),
        (
            "softmax cross-entropy, loss and gradient (1024 classes)",
            lambda: gpu.softmax_xent(logits, labels, float(logits.shape[0])),
            2 * logits.size * item,
        ),
    ]


def attention_figures(cp, t: int, repeats: int) -> list[Figure]:
    """The fused causal attention (``gpu_attention``, float32) at gpt_small's shape (batch 8,
    12 heads of 64, ``t`` positions), forward and backward, each round's time over the median
    of PyTorch's ``scaled_dot_product_attention(is_causal=True)`` on the same values, timed in
    turn with it."""
    import torch
    import torch.nn.functional as F

    from raysinga.kernels import gpu_attention

    n, h, hd = 8, 12, 64
    d, scale = h * hd, 1.0 / hd**0.5
    rng = cp.random.default_rng(1)
    qkv = rng.standard_normal((n, t, 3 * d), dtype=np.float32)
    dout = rng.standard_normal((n, t, d), dtype=np.float32)
    out, lse = gpu_attention.attention_forward(qkv, h, scale)
    # The same values as PyTorch's (n, h, t, hd) heads; .contiguous(): its kernels' own layout.
    heads = torch.as_tensor(qkv, device="cuda").view(n, t, 3, h, hd).permute(2, 0, 3, 1, 4)
    q, k, v = (x.contiguous().requires_grad_() for x in heads)
    tdout = torch.as_tensor(dout, device="cuda").view(n, t, h, hd).transpose(1, 2).contiguous()
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    torch.cuda.synchronize()

    def torch_timed(fn) -> list[float]:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times

    cases = [
        (
            "forward",
            lambda: gpu_attention.attention_forward(qkv, h, scale),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
        ),
        (
            "backward",
            lambda: gpu_attention.attention_backward(dout, qkv, out, lse, h, scale),
            lambda: torch.autograd.grad(y, (q, k, v), tdout, retain_graph=True),
        ),
    ]
    figures = []
    for name, ours, theirs in cases:
        ref = statistics.median(torch_timed(theirs))
        mine = timed(cp, ours, repeats)
        print(
            f"  attention {name}, T {t}: {statistics.median(mine) * 1e3:.2f} ms, PyTorch's "
            f"sdpa {ref * 1e3:.2f} ms (medians)"
        )
        label = f"attention {name} (8x12 heads of 64, T {t}, float32), time / PyTorch sdpa's"
        figures.append(Figure(label, [m / ref for m in mine], "x", ATTENTION_GOAL, "lower"))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of one array (default 256)")
    ap.add_argument("--repeats", type=int, default=20)
    add_json_option(ap)
    args = ap.parse_args()
    if not K.gpu_available():
        print(f"not measured: no usable GPU ({K.gpu_unavailable_reason()})")
        return
    cp = K.cupy_module()
    import cupyx

    from raysinga.actors.common.buffers import Layout, SharedBuffer
    from raysinga.actors.common.device import ServerDevice
    from raysinga.kernels import gpu

    dtype = np.float32
    n = (args.mib << 20) // np.dtype(dtype).itemsize
    src, dst = cp.ones(n, dtype), cp.empty(n, dtype)
    copy_bw = (
        2 * src.nbytes / statistics.median(timed(cp, lambda: cp.copyto(dst, src), args.repeats))
    )
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, float32, {args.mib} MiB")
    print(f"  device-to-device copy: {copy_bw / 1e9:8.1f} GB/s (median)")
    report = Report("bench_kernels", vars(args))
    for name, fn, nbytes in kernel_cases(cp, gpu, n, dtype):
        ratios = [nbytes / t / copy_bw for t in timed(cp, fn, args.repeats)]
        fig = Figure(f"{name}, bandwidth / the copy's", ratios, "x", GOAL, "higher")
        report.add(fig, ".2f")
        print(f"    {fig.value * copy_bw / 1e9:.1f} GB/s")

    slots = {f"s{i}/m": cp.full(n // 4, i, dtype) for i in range(4)}
    layout = Layout.of({"w": ((1,), "float32")})
    buf = SharedBuffer("bench-kernels", layout)
    dev = ServerDevice(layout, buf)
    try:

        def snapshot():
            _, done = dev.snapshot_slots(slots)
            done.synchronize()

        pinned = {k: cupyx.empty_pinned(a.shape, a.dtype) for k, a in slots.items()}

        def plain():
            for k, a in slots.items():
                a.get(out=pinned[k])

        snap, ref = timed(cp, snapshot, args.repeats), timed(cp, plain, args.repeats)
    finally:
        dev.close()
        buf.close()
    total = sum(a.nbytes for a in slots.values())
    print(
        f"snapshot to pinned host memory: {total / statistics.median(snap) / 1e9:6.1f} GB/s, a "
        f"plain pinned copy {total / statistics.median(ref) / 1e9:6.1f} GB/s (medians)"
    )
    ratios = [statistics.median(ref) / t for t in snap]
    report.add(Figure("snapshot, speed / the plain copy's", ratios, "x", GOAL, "higher"), ".2f")

    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("attention: not measured: no PyTorch with CUDA (pip install -e '.[bench]')")
    else:
        for t in (256, 1024):
            for fig in attention_figures(cp, t, args.repeats):
                report.add(fig, ".2f")
    report.write(args.json)


if __name__ == "__main__":
    main()
