"""Causal self-attention in bf16 through cuDNN's fused flash attention (NVIDIA's cuDNN frontend,
``nvidia-cudnn-frontend``): what a run with ``precision.compute: bf16`` uses on a GPU.

The attention's two products read bf16 operands and sum in float32, as the run's other matrix
products do (``precision.py``); the softmax runs in float32 inside cuDNN's kernel, which keeps
each row's statistics in place of the ``(T, T)`` probabilities and recomputes them in the
backward pass (FlashAttention-2, which cuDNN implements). The backward pass asks cuDNN for its
deterministic algorithm: the same inputs give the same bits, as raysinga's exact recovery needs.

The projection ``qkv`` (float32, ``(n, T, 3 * heads * head_dim)``) is cast to bf16 words once;
cuDNN reads queries, keys and values where they lie in those words and writes their gradients
back in that layout, so no head is copied out. Each shape's two cuDNN graphs are built once
(plans chosen by cuDNN's heuristics) with a workspace of their own that is never freed, so a
step recorded as a CUDA graph replays on the same memory.

Where the frontend cannot be imported, or cuDNN refuses a shape, :func:`fits` says no and the
layer computes the attention with its matrix products; :func:`refusals` says why, once per
reason. Imports CuPy: imported only once a CuPy array shows up.
"""

from __future__ import annotations

import threading
from typing import Any

import cupy
import numpy as np

from . import precision
from .gpu_launch import get_kernel, launch

HEAD_DIMS = (8, 16, 32, 64, 128)  # what cuDNN's bf16 flash attention takes on Ampere and later
_lock = threading.Lock()
_handles: dict[tuple[int, int], Any] = {}  # (device, stream) -> cuDNN handle bound to it
_graphs: dict[tuple, _Graphs] = {}
_refused: dict[tuple, str] = {}  # shapes cuDNN turned down, with its reason
_frontend: Any = None
_frontend_error: str | None = None
_tried = False


def frontend_error() -> str | None:
    """Why cuDNN's frontend cannot be used in this process (it is not installed, or its cuDNN
    is older than 9), or None."""
    global _frontend, _frontend_error, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                import cudnn  # noqa: PLC0415 - optional dependency (raysinga[gpu])

                version = cudnn.backend_version()
                if version < 90000:
                    _frontend_error = (
                        f"cuDNN {version} is older than 9.0, which fused attention needs"
                    )
                else:
                    _frontend = cudnn
            except Exception as e:  # noqa: BLE001 - ImportError, or a library that will not load
                _frontend_error = f"cuDNN's frontend cannot be loaded ({type(e).__name__}: {e})"
    return _frontend_error


def refusals() -> list[str]:
    """Why the attention took the matrix products instead, once per reason."""
    reasons = [] if frontend_error() is None else [frontend_error()]
    return reasons + sorted(set(_refused.values()))


def fits(qkv: cupy.ndarray, heads: int, scale: float = 1.0) -> bool:
    """Whether cuDNN's fused attention takes this projection ``(n, T, 3 * heads * head_dim)``:
    float32 values, heads of a width it takes, the frontend loaded, and the shape's graphs
    built (built here, once)."""
    if qkv.dtype != np.float32 or qkv.ndim != 3 or qkv.shape[2] % (3 * heads):
        return False
    hd = qkv.shape[2] // (3 * heads)
    if hd not in HEAD_DIMS or frontend_error() is not None:
        return False
    key = _key(qkv.shape, heads)
    if key in _refused:
        return False
    try:
        _graphs_for(key, scale)
    except Exception as e:  # noqa: BLE001 - cuDNN's refusal, whatever it raises
        _refused[key] = f"cuDNN refused attention of {key}: {type(e).__name__}: {e}"
        return False
    return True


def attention_forward(qkv: cupy.ndarray, heads: int, scale: float) -> tuple[cupy.ndarray, Any]:
    """``(out, saved)``: ``out`` (n, T, heads * head_dim) float32, each head's
    ``softmax(scale q k^T, causal) v`` side by side; ``saved`` what :func:`attention_backward`
    takes back (the bf16 operands and output, each row's softmax statistics)."""
    n, t, d3 = qkv.shape
    d = d3 // 3
    g = _graphs_for(_key(qkv.shape, heads), scale)
    words = precision.words_of(qkv)
    out16 = cupy.empty((n, t, d), cupy.uint16)
    stats = cupy.empty((n, heads, t, 1), cupy.float32)
    q, k, v = _operands(words, heads)
    o = _view(out16, (n, heads, t, d // heads), _o_strides(t, heads, d // heads))
    g.run(g.forward, {"q": q, "k": k, "v": v, "o": o, "stats": stats})
    return _from_bf16(out16, np.float32), (words, out16, stats)


def attention_backward(
    dout: cupy.ndarray, qkv: cupy.ndarray, out: cupy.ndarray, saved: Any, heads: int, scale: float
) -> cupy.ndarray:
    """The gradient ``(n, T, 3 * heads * head_dim)`` float32 of :func:`attention_forward` with
    respect to ``qkv``, laid out as ``qkv``."""
    del out  # its bf16 words are in saved, as cuDNN computed with them
    words, out16, stats = saved
    n, t, d3 = qkv.shape
    hd = d3 // 3 // heads
    g = _graphs_for(_key(qkv.shape, heads), scale)
    dout16 = precision.words_of(dout)
    dwords = cupy.empty((n, t, d3), cupy.uint16)
    q, k, v = _operands(words, heads)
    dq, dk, dv = _operands(dwords, heads)
    o_strides = _o_strides(t, heads, hd)
    o = _view(out16, (n, heads, t, hd), o_strides)
    do = _view(dout16, (n, heads, t, hd), o_strides)
    pack = {"q": q, "k": k, "v": v, "o": o, "do": do, "stats": stats}
    g.run(g.backward, {**pack, "dq": dq, "dk": dk, "dv": dv})
    return _from_bf16(dwords, np.float32)


# ---------------------------------------------------------------- cuDNN's graphs


def _key(shape: tuple[int, ...], heads: int) -> tuple[int, int, int, int]:
    n, t, d3 = shape
    return (n, t, heads, d3 // 3 // heads)


def _qkv_strides(t: int, h: int, hd: int) -> list[int]:
    """Strides (elements) of a head's q, k or v as (n, h, T, hd) in the projection's words
    (n, T, 3, h, hd)."""
    return [t * 3 * h * hd, hd, 3 * h * hd, 1]


def _o_strides(t: int, h: int, hd: int) -> list[int]:
    """Strides of the output as (n, h, T, hd) where it lies as (n, T, h, hd)."""
    return [t * h * hd, hd, h * hd, 1]


def _view(words: cupy.ndarray, shape, strides) -> cupy.ndarray:
    from cupy.lib.stride_tricks import as_strided  # noqa: PLC0415

    return as_strided(words, shape=shape, strides=[s * words.itemsize for s in strides])


def _operands(words: cupy.ndarray, heads: int) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """q, k, v as (n, h, T, hd) views of the projection's words (n, T, 3 * h * hd)."""
    n, t, d3 = words.shape
    d = d3 // 3
    shape, strides = (n, heads, t, d // heads), _qkv_strides(t, heads, d // heads)
    return tuple(_view(words[:, :, j * d :], shape, strides) for j in range(3))  # type: ignore[return-value]


class _Graphs:
    """The forward and backward graphs of one shape and scale, their tensors by name, and one
    workspace for both (they never run at once)."""

    def __init__(self, cudnn: Any, key: tuple[int, int, int, int], scale: float) -> None:
        n, t, h, hd = key
        bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
        qkv_s, o_s, dims = _qkv_strides(t, h, hd), _o_strides(t, h, hd), [n, h, t, hd]
        stats_dims, stats_s = [n, h, t, 1], [h * t, t, 1, 1]

        def graph() -> Any:
            return cudnn.pygraph(
                io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32
            )

        fwd = graph()
        ft = {name: fwd.tensor(name=name, dim=dims, stride=qkv_s, data_type=bf16) for name in "qkv"}
        o, stats = fwd.sdpa(
            name="sdpa", q=ft["q"], k=ft["k"], v=ft["v"], is_inference=False,
            attn_scale=float(scale), use_causal_mask=True,
        )  # fmt: skip
        o.set_output(True).set_dim(dims).set_stride(o_s).set_data_type(bf16)
        stats.set_output(True).set_dim(stats_dims).set_stride(stats_s).set_data_type(f32)
        ft.update(o=o, stats=stats)
        self.forward = (fwd, ft)

        bwd = graph()
        bt = {name: bwd.tensor(name=name, dim=dims, stride=qkv_s, data_type=bf16) for name in "qkv"}
        bt["o"] = bwd.tensor(name="o", dim=dims, stride=o_s, data_type=bf16)
        bt["do"] = bwd.tensor(name="do", dim=dims, stride=o_s, data_type=bf16)
        bt["stats"] = bwd.tensor(name="stats", dim=stats_dims, stride=stats_s, data_type=f32)
        dq, dk, dv = bwd.sdpa_backward(
            name="sdpa_backward", q=bt["q"], k=bt["k"], v=bt["v"], o=bt["o"], dO=bt["do"],
            stats=bt["stats"], attn_scale=float(scale), use_causal_mask=True,
            use_deterministic_algorithm=True,
        )  # fmt: skip
        for name, tensor in (("dq", dq), ("dk", dk), ("dv", dv)):
            tensor.set_output(True).set_dim(dims).set_stride(qkv_s).set_data_type(bf16)
            bt[name] = tensor
        self.backward = (bwd, bt)

        heuristics = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
        for g, _ in (self.forward, self.backward):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans(heuristics)
            g.check_support()
            g.build_plans()
        size = max(self.forward[0].get_workspace_size(), self.backward[0].get_workspace_size())
        self.workspace = cupy.empty(max(size, 1), cupy.uint8)
        self.cudnn = cudnn

    def run(self, which: tuple[Any, dict[str, Any]], arrays: dict[str, cupy.ndarray]) -> None:
        g, tensors = which
        # by address (the frontend takes ints): no DLPack exchange, which could synchronise
        # streams, and so could not be recorded in a CUDA graph
        pack = {tensors[name]: a.data.ptr for name, a in arrays.items()}
        g.execute(pack, self.workspace.data.ptr, handle=_handle(self.cudnn))


def _graphs_for(key: tuple[int, int, int, int], scale: float = 1.0) -> _Graphs:
    full = (*key, float(scale), cupy.cuda.Device().id)
    g = _graphs.get(full)
    if g is None:
        frontend_error()
        g = _graphs[full] = _Graphs(_frontend, key, scale)
    return g


def _handle(cudnn: Any) -> Any:
    """A cuDNN handle of this device bound to the current stream (one per stream, kept)."""
    where = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    h = _handles.get(where)
    if h is None:
        h = _handles[where] = cudnn.create_handle()
        cudnn.set_stream(handle=h, stream=where[1])
    return h


# ---------------------------------------------------------------- casts


def _from_bf16(words: cupy.ndarray, dtype) -> cupy.ndarray:
    out = cupy.empty(words.shape, dtype)
    launch(get_kernel("precision.cu", "from_bf16", out.dtype), out.size, words, out, out.size)
    return out
