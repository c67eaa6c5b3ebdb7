"""One training step of raysinga's layers against the same model in PyTorch, in one run.

MLP 784-1024-1024-10, float32, batch 256, softmax cross-entropy, SGD with momentum 0.9; with
``--model cnn``, the example CNN of ``examples/digits_cnn.yaml`` (two 3x3 convolutions, batch
normalisation, max pooling, dropout, two dense layers) on 1x8x8 images at its batch of 64; with
``--model charlm``, the GPT-style language model of ``examples/charlm.yaml`` (4 blocks of width
128, context 128) at its batch of 32, against ``torch_interop.torch_module`` of its spec. A step
is forward, backward and the parameter update, on data already on the device. raysinga's NumPy
backend runs against PyTorch on the CPU with the same thread count; where CuPy and a CUDA device
are usable, raysinga's CuPy kernels run against PyTorch on that GPU as well::

    pip install -e '.[bench,examples]'
    python benchmarks/bench_step.py [--model mlp|cnn|charlm] [--steps 50] [--rounds 5]
        [--device all|cpu|gpu]

The two sides alternate round by round and the ratio is taken of the medians, so drifts of a
noisy machine fall on both; it is printed with the lowest and highest of the rounds' own
ratios, and ``--json FILE`` writes every round. Goals: MLP at most 1.0x PyTorch's step time on
the CPU and 0.9x on a GPU; CNN at most 1.2x on a GPU; charlm at most 1.2x on the CPU and on a
GPU (PyTorch eager).

On a GPU it then measures raysinga's step recorded as a CUDA graph (``gpu.graphs``) against
PyTorch eager and ``torch.compile(mode="reduce-overhead")``, the three taking turns. Goals:
MLP at most 0.35x eager and 0.5x compiled; CNN 0.35x and 0.7x; charlm 0.6x eager.
"""

from __future__ import annotations

import os

# As raysinga's processes start (kernels/cpu_threads.py, BLAS_ENV): OpenBLAS reads it as it loads,
# so before NumPy is imported; main() checks the two agree.
BLAS_DEFAULTS = {"OPENBLAS_THREAD_TIMEOUT": "20"}
for _k, _v in BLAS_DEFAULTS.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from bench_distributed import BATCH, CLASSES, DIM, HIDDEN  # noqa: E402 - the same MLP and shapes
from bench_distributed import MODEL as MLP_SPEC  # noqa: E402
from report import Figure, Report, add_json_option  # noqa: E402

LR, MOMENTUM = 0.01, 0.9
SETTLE_S = 0.5
CNN_YAML = Path(__file__).resolve().parents[1] / "examples" / "digits_cnn.yaml"
CHARLM_YAML = CNN_YAML.with_name("charlm.yaml")
# The recorded GPU step's goals (gpu.graphs), against each GPU peer.
GRAPH_GOALS = {
    "mlp": {"eager": 0.35, "compiled": 0.5},
    "cnn": {"eager": 0.35, "compiled": 0.7},
    "charlm": {"eager": 0.6, "compiled": None},
}


def cnn_spec() -> tuple[dict, int]:
    """The example CNN's model section and batch size."""
    from raysinga import config

    cfg = config.load(CNN_YAML)
    return cfg.model.to_dict(), cfg.data.batch_size


def torch_cnn(torch):
    """The example CNN in PyTorch, layer for layer."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(16),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def torch_mlp(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def charlm_spec() -> tuple[dict, int]:
    """The example GPT-style language model's model section and batch size."""
    from raysinga import config

    cfg = config.load(CHARLM_YAML)
    return cfg.model.to_dict(), cfg.data.batch_size


def torch_charlm(torch):
    """The same model in PyTorch: torch_interop's module of the example's spec."""
    from raysinga.nn.model import ModelSpec
    from raysinga.nn.torch_interop import torch_module

    return torch_module(ModelSpec.from_dict(charlm_spec()[0]))


MODELS = {  # name: (raysinga spec and batch, sample shape, PyTorch twin)
    "mlp": (lambda: (MLP_SPEC, BATCH), (DIM,), torch_mlp),
    "cnn": (cnn_spec, (1, 8, 8), torch_cnn),
    "charlm": (charlm_spec, (128,), torch_charlm),
}
VOCAB = 98  # the charlm's: token ids as inputs, the next token at every position as labels


def batches(
    n: int, batch: int, shape: tuple[int, ...], tokens: bool = False
) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    if tokens:
        return [
            (rng.integers(0, VOCAB, (batch, *shape)), rng.integers(0, VOCAB, (batch, *shape)))
            for _ in range(n)
        ]
    return [
        (
            rng.standard_normal((batch, *shape), dtype=np.float32),
            rng.integers(0, CLASSES, batch).astype(np.int64),
        )
        for _ in range(n)
    ]


class Ours:
    def __init__(self, device: str, data: list, spec: dict) -> None:
        from raysinga import kernels as K
        from raysinga.nn.layers import StepContext
        from raysinga.nn.model import ModelSpec, Net
        from raysinga.optim.optimizers import SGD

        self.xp = xp = K.xp_for(device)
        self.net = Net(ModelSpec.from_dict(spec))
        self.params = {k: xp.asarray(v) for k, v in self.net.init_params(0).items()}
        self.state = {k: xp.asarray(v) for k, v in self.net.init_state().items()}
        self.opt = SGD(lr=LR, momentum=MOMENTUM)
        self.data = [(xp.asarray(x), xp.asarray(y)) for x, y in data]
        self.ctx = StepContext(train=True)
        self.t = 0

    def step(self) -> None:
        """One step: forward, backward and the update, on the next batch."""
        x, y = self.data[self.t % len(self.data)]
        _, grads, _ = self.net.loss_and_grads(self.params, self.state, x, y, self.ctx)
        self.opt.update_all(self.t, self.params, grads)
        self.t += 1

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()
        return (time.perf_counter() - t0) / n


class OursGraphs(Ours):
    """raysinga's GPU step recorded as a CUDA graph and replayed (``gpu.graphs``): the batch is
    staged from host memory at every step, as in a run (the peers' batches stay on the device),
    and the losses are read back every few steps, as the trainer does."""

    def __init__(self, device: str, data: list, spec: dict) -> None:
        super().__init__(device, data, spec)
        from raysinga.run.graph_step import GraphStep

        self.host = data
        self.graph = GraphStep(self.net, self.opt, self.params, self.state, None, print, "strict")

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = self.host[self.t % len(self.host)]
            self.graph.step(self.t, self.ctx, x, y)
            self.t += 1
        self.graph.results(force=True)
        self.graph.synchronize()
        return (time.perf_counter() - t0) / n


class Torch:
    """The PyTorch twin, eager; ``compiled``: under ``torch.compile(mode="reduce-overhead")``
    (TorchInductor's kernels, replayed as CUDA graphs), the step compiled whole."""

    def __init__(self, device: str, data: list, make, compiled: bool = False) -> None:
        import torch

        self.torch = torch
        self.dev = torch.device("cuda" if device == "gpu" else "cpu")
        torch.manual_seed(0)
        self.model = make(torch).to(self.dev)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.data = [
            (torch.from_numpy(x).to(self.dev), torch.from_numpy(y).to(self.dev)) for x, y in data
        ]
        self.t = 0
        self._step = self._eager
        if compiled:
            graphed = torch.compile(self._eager, mode="reduce-overhead")

            def step(x, y) -> None:
                # Each call is a new training step: without the mark, the replay of the next
                # step overwrites outputs that the optimizer's state still reads, and PyTorch
                # refuses the run ("accessing tensor output of CUDAGraphs that has been
                # overwritten by a subsequent run").
                torch.compiler.cudagraph_mark_step_begin()
                graphed(x, y)

            self._step = step

    def _eager(self, x, y) -> None:
        torch = self.torch
        out = self.model(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def steps(self, n: int) -> float:
        torch = self.torch
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = self.data[self.t % len(self.data)]
            self._step(x, y)
            self.t += 1
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n


def compare(device: str, model: str, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds per step of each round: raysinga's and PyTorch's, the rounds alternating."""
    spec_batch, shape, make = MODELS[model]
    spec, batch = spec_batch()
    data = batches(8, batch, shape, tokens=model == "charlm")
    sides = alternate([Ours(device, data, spec), Torch(device, data, make)], steps, rounds)
    return sides[0], sides[1]


def alternate(sides: list, steps: int, rounds: int, warm: int = 5) -> list[list[float]]:
    """Seconds per step of each side in each round, the sides taking turns."""
    for side in sides:
        side.steps(warm)  # warm-up: allocations, kernel compilation, BLAS threads, graphs
    times: list[list[float]] = [[] for _ in sides]
    for _ in range(rounds):
        for side, t in zip(sides, times, strict=True):
            # Each side starts once the other's idle threads have stopped spinning (OpenBLAS's
            # and OpenMP's spin for up to about 0.1 s after their last call): the cores are its
            # own.
            time.sleep(SETTLE_S)
            t.append(side.steps(steps))
    return times


def compare_graphs(model: str, steps: int, rounds: int) -> dict[str, list[float]]:
    """On the GPU: raysinga's recorded step against PyTorch eager and PyTorch compiled
    (``None`` for compiled where torch.compile cannot run here), the rounds alternating."""
    spec_batch, shape, make = MODELS[model]
    spec, batch = spec_batch()
    data = batches(8, batch, shape, tokens=model == "charlm")
    sides = {"graphs": OursGraphs("gpu", data, spec), "eager": Torch("gpu", data, make)}
    try:
        compiled = Torch("gpu", data, make, compiled=True)
        compiled.steps(3)  # compiles: minutes at most, once
        sides["compiled"] = compiled
    except Exception as e:  # no Triton, or a compiler error: say so, measure the rest
        print(f"gpu: torch.compile not measured ({type(e).__name__}: {e})".splitlines()[0])
    times = alternate(list(sides.values()), steps, rounds)
    return dict(zip(sides, times, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="mlp")
    ap.add_argument("--steps", type=int, default=50, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per side, alternating")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads, both sides")
    ap.add_argument(
        "--device",
        choices=("all", "cpu", "gpu"),
        default="all",
        help="the side(s) to measure: the CPU, the GPU (where usable) or both (default)",
    )
    add_json_option(ap)
    a = ap.parse_args()

    import torch

    from raysinga import kernels as K
    from raysinga.kernels.cpu_threads import BLAS_ENV

    torch.set_num_threads(a.threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(a.threads)
    except ImportError:
        pass
    what = {
        "mlp": f"MLP {DIM}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {BATCH}",
        "cnn": f"the example CNN ({CNN_YAML.name}), batch {MODELS['cnn'][0]()[1]}",
        "charlm": f"the example language model ({CHARLM_YAML.name}), batch "
        f"{MODELS['charlm'][0]()[1]} x 128 characters",
    }[a.model]
    if BLAS_DEFAULTS != BLAS_ENV:
        raise SystemExit(f"bench_step sets {BLAS_DEFAULTS}, raysinga's processes {BLAS_ENV}")
    blas = " ".join(f"{k}={os.environ[k]}" for k in sorted(BLAS_ENV))
    print(
        f"{what}, float32, SGD momentum; {a.threads} CPU threads, torch {torch.__version__}, "
        f"numpy {np.__version__}, {blas}"
    )
    goals = {
        "mlp": {"cpu": 1.0, "gpu": 0.9},
        "cnn": {"cpu": None, "gpu": 1.2},
        "charlm": {"cpu": 1.2, "gpu": 1.2},
    }[a.model]
    report = Report("bench_step", {**vars(a), "torch": torch.__version__, "numpy": np.__version__})
    devices = [] if a.device == "gpu" else ["cpu"]
    if a.device != "cpu":
        if K.gpu_available() and torch.cuda.is_available():
            devices.append("gpu")
        else:
            why = K.gpu_unavailable_reason() or "PyTorch sees no CUDA device"
            print(f"gpu: not measured ({why})")
    for dev in devices:
        ours, peer = compare(dev, a.model, a.steps, a.rounds)
        report.add(Figure(f"{dev}: raysinga step", [t * 1e3 for t in ours], " ms"), ".2f")
        report.add(Figure(f"{dev}: PyTorch step", [t * 1e3 for t in peer], " ms"), ".2f")
        # The goal is on the ratio of the two medians; the rounds' own ratios show the spread.
        report.add(
            Figure(
                f"{dev}: raysinga / PyTorch step time",
                [x / y for x, y in zip(ours, peer, strict=True)],
                "x",
                goals[dev],
                value=statistics.median(ours) / statistics.median(peer),
            )
        )
    if "gpu" in devices:
        times = compare_graphs(a.model, a.steps, a.rounds)
        ms = {k: [t * 1e3 for t in v] for k, v in times.items()}
        report.add(Figure("gpu: raysinga step, CUDA graph", ms["graphs"], " ms"), ".3f")
        if "compiled" in ms:
            report.add(Figure("gpu: PyTorch step, torch.compile", ms["compiled"], " ms"), ".3f")
        for peer, goal in GRAPH_GOALS[a.model].items():
            if peer not in times:
                continue
            what = {"eager": "PyTorch eager", "compiled": "torch.compile reduce-overhead"}[peer]
            report.add(
                Figure(
                    f"gpu: raysinga (graph) / {what} step time",
                    [x / y for x, y in zip(times["graphs"], times[peer], strict=True)],
                    "x",
                    goal,
                    value=statistics.median(times["graphs"]) / statistics.median(times[peer]),
                )
            )
    report.write(a.json)


if __name__ == "__main__":
    main()
