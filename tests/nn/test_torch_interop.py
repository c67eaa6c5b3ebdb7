"""Weights to and from PyTorch: the exported state_dict loads into the equivalent torch.nn
model, which then computes raysinga's outputs; a PyTorch state_dict starts a training run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_LM, cli_error, load_job

from raysinga import config
from raysinga.checkpoint import Checkpoint
from raysinga.cli import main
from raysinga.nn.layers import StepContext
from raysinga.nn.model import Net
from raysinga.nn.torch_interop import from_state_dict, load, to_state_dict, torch_module
from raysinga.run import Trainer

torch = pytest.importorskip("torch")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUIET = {"log": lambda line: None}


def _outputs_match(cfg, ck: Checkpoint, pt: Path, x: np.ndarray) -> None:
    net = Net(cfg.model, dtype=cfg.dtype)
    want = net.forward(ck.arrays("param"), ck.arrays("state"), x, StepContext(train=False))
    model = torch_module(cfg.model, cfg.dtype)
    model.load_state_dict(torch.load(pt, weights_only=True))
    model.eval()
    with torch.no_grad():
        got = model(torch.from_numpy(x)).numpy()
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 1e-5 * scale, "outputs differ beyond 1e-5"


@pytest.mark.parametrize("job", ["charlm", "chargru", "digits_cnn", "custom_layers/charlm"])
def test_an_exported_model_computes_the_same_in_pytorch(job, tmp_path):
    """Each example trained a few steps (batch-norm statistics and all), exported with
    --format torch, loaded into torch_module's model: the same outputs to 1e-5 relative."""
    sets = [f"run_dir={tmp_path}", "train_steps=3", "test_freq=0", "disp_freq=3"]
    if job != "digits_cnn":
        sets += ["data.source.max_chars=200000", "data.source.valid_every=5", "data.batch_size=4"]
    cfg = config.load(EXAMPLES / f"{job}.yaml", sets)
    Trainer(cfg, **QUIET).fit()
    ck = Checkpoint.open(Path(cfg.checkpoint_dir) / "step-3")
    pt = tmp_path / "model.pt"
    assert main(["export", str(ck.location), "--format", "torch", "-o", str(pt)]) == 0
    rng = np.random.default_rng(0)
    if job == "digits_cnn":
        x = rng.random((5, 1, 8, 8)).astype(np.float32)
    else:
        x = rng.integers(0, 98, size=(3, cfg.model.input_shape[0]))
    _outputs_match(cfg, ck, pt, x)
    sd = load(str(pt))
    net = Net(cfg.model, dtype=cfg.dtype)
    back = from_state_dict(net, sd)  # and back again: the same bits
    stored = {**ck.arrays("param"), **ck.arrays("state")}
    assert set(back) == {*net.param_shapes(), *net.state_shapes()}
    for k, v in back.items():
        assert v.tobytes() == stored[k].tobytes(), k


def test_a_pytorch_state_dict_starts_a_run(tmp_path):
    """A model made in PyTorch (its own initialisation, a few of its own steps), saved with
    torch.save: --init-from trains from exactly its weights."""
    cfg = load_job(tmp_path / "a", TINY_LM)
    model = torch_module(cfg.model, "float32")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 98, (4, 16))
    for _ in range(2):
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        opt.step()
    pt = tmp_path / "torch-model.pt"
    torch.save(model.state_dict(), pt)
    b = tmp_path / "b"
    load_job(b, TINY_LM)
    sets = ["--set", f"run_dir={b}", "--set", "train_steps=1", "--set", "checkpoint_frequency=1"]
    assert main(["train", str(b / "job.yaml"), *sets, "--init-from", str(pt)]) == 0
    net = Net(cfg.model)
    start = Checkpoint.open(b / "from-torch" / "step-0").arrays("param")
    want = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert to_state_dict(net, start, {}).keys() == want.keys()
    for k, v in to_state_dict(net, start, {}).items():
        assert v.tobytes() == np.ascontiguousarray(want[k]).tobytes(), k
    trained = Checkpoint.open(b / "checkpoints" / "step-1").arrays("param")
    assert any(not np.array_equal(trained[k], start[k]) for k in start)  # it trained from there


def test_a_state_dict_of_another_model_is_named(tmp_path):
    load_job(tmp_path, TINY_LM)
    other = torch.nn.Linear(3, 4)
    pt = tmp_path / "other.pt"
    torch.save(other.state_dict(), pt)
    job = str(tmp_path / "job.yaml")
    cli_error("train", job, "--init-from", str(pt), named=["tok.weight"])
    sd = torch_module(config.load(tmp_path / "job.yaml").model).state_dict()
    sd["head.weight"] = sd["head.weight"][:, :5]
    torch.save(sd, pt)
    cli_error("train", job, "--init-from", str(pt), named=["head.weight", "[98, 5]"])
    (tmp_path / "garbage.pt").write_bytes(b"not a zip, not a pickle")
    cli_error("train", job, "--init-from", str(tmp_path / "garbage.pt"), named=["garbage.pt"])
