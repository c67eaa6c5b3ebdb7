"""One training step of raysinga's layers against the same model in PyTorch, in one run.

MLP 784-1024-1024-10, float32, batch 256, softmax cross-entropy, SGD with momentum 0.9. A step
is forward, backward and the parameter update, on data already on the device. raysinga's NumPy
backend runs against PyTorch on the CPU with the same thread count; where CuPy and a CUDA device
are usable, raysinga's CuPy kernels run against PyTorch on that GPU as well::

    pip install -e '.[bench,examples]'
    python benchmarks/bench_step.py [--steps 50] [--rounds 5] [--threads N]

The two sides alternate round by round and the ratio is taken of the medians, so drifts of a
noisy machine fall on both. Goals: at most 1.0x PyTorch's step time on the CPU, 0.9x on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from bench_distributed import BATCH, CLASSES, DIM, HIDDEN  # the same MLP, batch and shapes
from bench_distributed import MODEL as SPEC

LR, MOMENTUM = 0.01, 0.9


def batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.standard_normal((BATCH, DIM), dtype=np.float32),
            rng.integers(0, CLASSES, BATCH).astype(np.int64),
        )
        for _ in range(n)
    ]


class Ours:
    def __init__(self, device: str, data: list) -> None:
        from raysinga import kernels as K
        from raysinga.layers import StepContext
        from raysinga.model import ModelSpec, Net
        from raysinga.optim import SGD

        self.xp = xp = K.xp_for(device)
        self.net = Net(ModelSpec.from_dict(SPEC))
        self.params = {k: xp.asarray(v) for k, v in self.net.init_params(0).items()}
        self.state = {k: xp.asarray(v) for k, v in self.net.init_state().items()}
        self.opt = SGD(lr=LR, momentum=MOMENTUM)
        self.data = [(xp.asarray(x), xp.asarray(y)) for x, y in data]
        self.ctx = StepContext(train=True)
        self.t = 0

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = self.data[self.t % len(self.data)]
            _, grads, _ = self.net.loss_and_grads(self.params, self.state, x, y, self.ctx)
            self.opt.update_all(self.t, self.params, grads)
            self.t += 1
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()
        return (time.perf_counter() - t0) / n


class Torch:
    def __init__(self, device: str, data: list) -> None:
        import torch

        self.torch = torch
        self.dev = torch.device("cuda" if device == "gpu" else "cpu")
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(DIM, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, CLASSES),
        ).to(self.dev)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.data = [
            (torch.from_numpy(x).to(self.dev), torch.from_numpy(y).to(self.dev)) for x, y in data
        ]
        self.t = 0

    def steps(self, n: int) -> float:
        torch = self.torch
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = self.data[self.t % len(self.data)]
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.t += 1
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n


def compare(device: str, steps: int, rounds: int) -> float:
    data = batches(8)
    ours, peer = Ours(device, data), Torch(device, data)
    ours.steps(5), peer.steps(5)  # warm-up: allocations, kernel compilation, BLAS threads
    t_ours, t_peer = [], []
    for _ in range(rounds):
        t_ours.append(ours.steps(steps))
        t_peer.append(peer.steps(steps))
    a, b = statistics.median(t_ours), statistics.median(t_peer)
    print(f"{device}: raysinga {a * 1e3:7.2f} ms/step   PyTorch {b * 1e3:7.2f} ms/step")
    print(
        f"{device}: raysinga / PyTorch step time = {a / b:.3f}x  (rounds: "
        + ", ".join(f"{x / y:.2f}" for x, y in zip(t_ours, t_peer, strict=True))
        + ")"
    )
    return a / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per side, alternating")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads, both sides")
    a = ap.parse_args()

    import torch

    from raysinga import kernels as K

    torch.set_num_threads(a.threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(a.threads)
    except ImportError:
        pass
    print(
        f"MLP {DIM}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {BATCH}, float32, SGD momentum; "
        f"{a.threads} CPU threads, torch {torch.__version__}, numpy {np.__version__}"
    )
    ratios = {"cpu": compare("cpu", a.steps, a.rounds)}
    if K.gpu_available() and torch.cuda.is_available():
        ratios["gpu"] = compare("gpu", a.steps, a.rounds)
    else:
        print(f"gpu: not measured ({K.gpu_unavailable_reason() or 'PyTorch sees no CUDA device'})")
    goals = {"cpu": 1.0, "gpu": 0.9}
    for dev, r in ratios.items():
        print(f"goal {dev}: at most {goals[dev]:.1f}x -> {'met' if r <= goals[dev] else 'NOT met'}")


if __name__ == "__main__":
    main()
