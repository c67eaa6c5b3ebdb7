"""Mixed precision on a GPU: raysinga's ``precision.compute`` against PyTorch's own, in one run.

Two models, each trained a few steps per round, the sides taking turns:

- the MLP 4096-8192-8192-1000 at batch 4096 (SGD with momentum), float32, TF32 and bf16:
  raysinga with ``precision.compute`` f32, tf32 and bf16 against PyTorch float32, PyTorch with
  TF32 matrix products (``torch.backends.cuda.matmul.allow_tf32``) and PyTorch under bf16
  autocast;
- ``examples/gpt_small.yaml`` (12 blocks of width 768, context 256, about 85 M parameters) in
  bf16 against its ``torch_interop`` twin under bf16 autocast, eager, in tokens per second::

    pip install -e '.[bench,gpu]'
    python benchmarks/bench_precision.py [--steps 10] [--rounds 5] [--json FILE]

Goals: the MLP's bf16 step at most 1.0x PyTorch's bf16 autocast step and its TF32 step at most
1.0x PyTorch's TF32 step; gpt_small at least 1.0x PyTorch's tokens per second. Median of the
rounds, with min and max. Needs a GPU (exits 1 without one, saying why).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from bench_step import alternate
from report import Figure, Report, add_json_option

MLP = (4096, 8192, 8192, 1000)
MLP_BATCH = 4096
GPT_YAML = Path(__file__).resolve().parents[1] / "examples" / "gpt_small.yaml"
GOALS = {"tf32": 1.0, "bf16": 1.0}


def mlp_spec() -> dict:
    d, h1, h2, out = MLP
    return {
        "input_shape": [d],
        "layers": [
            {"kind": "dense", "name": "fc1", "units": h1, "activation": "relu"},
            {"kind": "dense", "name": "fc2", "units": h2, "activation": "relu"},
            {"kind": "dense", "name": "out", "units": out},
        ],
    }


class Ours:
    """raysinga's layers on the GPU in one precision (set for this process while it steps)."""

    def __init__(self, spec: dict, batch: tuple, policy: str, optimizer: dict) -> None:
        from raysinga import kernels as K
        from raysinga.nn.layers import StepContext
        from raysinga.nn.model import ModelSpec, Net
        from raysinga.optim.optimizers import make_optimizer

        self.cp = K.cupy_module()
        self.net = Net(ModelSpec.from_dict(spec))
        self.params = {k: self.cp.asarray(v) for k, v in self.net.init_params(0).items()}
        self.state = {k: self.cp.asarray(v) for k, v in self.net.init_state().items()}
        self.opt = make_optimizer(optimizer)
        self.x, self.y = (self.cp.asarray(a) for a in batch)
        self.ctx = StepContext(train=True)
        self.policy = policy
        self.t = 0

    def steps(self, n: int) -> float:
        from raysinga.kernels import precision

        with precision.using(self.policy):
            self.cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                _, grads, _ = self.net.loss_and_grads(
                    self.params, self.state, self.x, self.y, self.ctx
                )
                self.opt.update_all(self.t, self.params, grads)
                self.t += 1
            self.cp.cuda.Device().synchronize()
        return (time.perf_counter() - t0) / n


class Torch:
    """The PyTorch twin in float32, with TF32 matrix products, or under bf16 autocast."""

    def __init__(self, module, batch: tuple, policy: str, optimizer: str) -> None:
        import torch

        self.torch, self.policy = torch, policy
        self.model = module.cuda()
        params = self.model.parameters()
        self.opt = (
            torch.optim.SGD(params, lr=0.01, momentum=0.9)
            if optimizer == "sgd"
            else torch.optim.AdamW(params, lr=6e-4, weight_decay=0.1)
        )
        self.x, self.y = (torch.from_numpy(a).cuda() for a in batch)

    def steps(self, n: int) -> float:
        torch = self.torch
        torch.backends.cuda.matmul.allow_tf32 = self.policy == "tf32"
        torch.backends.cudnn.allow_tf32 = self.policy == "tf32"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.policy == "bf16"):
                out = self.model(self.x)
                loss = torch.nn.functional.cross_entropy(
                    out.reshape(-1, out.shape[-1]).float(), self.y.reshape(-1)
                )
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        torch.cuda.synchronize()
        torch.backends.cuda.matmul.allow_tf32 = False
        return (time.perf_counter() - t0) / n


def torch_mlp(torch):
    d, h1, h2, out = MLP
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(d, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(), nn.Linear(h2, out)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", default="mlp,gpt_small", help="comma-separated: mlp, gpt_small")
    add_json_option(ap)
    a = ap.parse_args()

    import torch

    from raysinga import config
    from raysinga import kernels as K
    from raysinga.nn.torch_interop import torch_module

    if not (K.gpu_available() and torch.cuda.is_available()):
        why = K.gpu_unavailable_reason() or "PyTorch sees no CUDA device"
        print(f"bench_precision needs a GPU: {why}")
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    report = Report("bench_precision", {**vars(a), "torch": torch.__version__})
    rng = np.random.default_rng(0)
    models = a.models.split(",")
    if "mlp" in models:
        x = rng.standard_normal((MLP_BATCH, MLP[0]), dtype=np.float32)
        y = rng.integers(0, MLP[-1], MLP_BATCH).astype(np.int64)
        sgd = {"name": "sgd", "lr": 0.01, "momentum": 0.9}
        for policy in ("f32", "tf32", "bf16"):
            torch.manual_seed(0)
            ours = Ours(mlp_spec(), (x, y), policy, sgd)
            peer = Torch(torch_mlp(torch), (x, y), policy, "sgd")
            t_ours, t_peer = alternate([ours, peer], a.steps, a.rounds, warm=2)
            flops = 6 * MLP_BATCH * sum(m * n for m, n in zip(MLP, MLP[1:], strict=False))
            ms = [t * 1e3 for t in t_ours]
            report.add(Figure(f"MLP {policy}: raysinga step", ms, " ms"), ".2f")
            report.add(Figure(f"MLP {policy}: PyTorch step", [t * 1e3 for t in t_peer], " ms"))
            report.add(
                Figure(f"MLP {policy}: raysinga TFLOP/s", [flops / t / 1e12 for t in t_ours]),
                ".0f",
            )
            report.add(
                Figure(
                    f"MLP {policy}: raysinga / PyTorch step time",
                    [o / p for o, p in zip(t_ours, t_peer, strict=True)],
                    "x",
                    GOALS.get(policy),
                    value=statistics.median(t_ours) / statistics.median(t_peer),
                )
            )
    if "gpt_small" in models:
        cfg = config.load(GPT_YAML)
        spec = cfg.model.to_dict()
        batch, context = cfg.data.batch_size, cfg.model.input_shape[0]
        x = rng.integers(0, 98, (batch, context)).astype(np.int64)
        y = rng.integers(0, 98, (batch, context)).astype(np.int64)
        torch.manual_seed(0)
        ours = Ours(spec, (x, y), "bf16", {"name": "adamw", "lr": 6e-4, "weight_decay": 0.1})
        peer = Torch(torch_module(cfg.model), (x, y), "bf16", "adamw")
        t_ours, t_peer = alternate([ours, peer], a.steps, a.rounds, warm=2)
        tokens = batch * context
        report.add(Figure("gpt_small bf16: raysinga tokens/s", [tokens / t for t in t_ours]))
        report.add(Figure("gpt_small bf16: PyTorch tokens/s", [tokens / t for t in t_peer]))
        report.add(
            Figure(
                "gpt_small bf16: raysinga / PyTorch tokens per second",
                [p / o for o, p in zip(t_ours, t_peer, strict=True)],
                "x",
                1.0,
                "higher",
                value=statistics.median(t_peer) / statistics.median(t_ours),
            )
        )
    report.write(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
