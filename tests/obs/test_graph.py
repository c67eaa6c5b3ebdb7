"""`raysinga graph`: the net as JSON and as a drawing."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from raysinga import config
from raysinga.cli import main
from raysinga.nn.model import Net
from raysinga.obs.graph import write_graph

draws = pytest.mark.skipif(find_spec("matplotlib") is None, reason="matplotlib is not installed")

CNN = Path(__file__).resolve().parents[2] / "examples" / "digits_cnn.yaml"


@draws
def test_the_json_has_every_layer_with_shapes_and_parameters(tmp_path):
    cfg = config.load(CNN)
    js, png = write_graph(cfg, tmp_path / "net.png")
    net = json.loads(js.read_text())
    assert net["name"] == "digits-cnn" and net["input_shape"] == [1, 8, 8]
    assert [ly["name"] for ly in net["layers"]] == [ls.name for ls in cfg.model.layers]
    by_name = {ly["name"]: ly for ly in net["layers"]}
    assert by_name["conv1"]["output_shape"] == [16, 8, 8]
    assert by_name["pool"]["output_shape"] == [32, 4, 4]
    assert by_name["flat"]["output_shape"] == [512]
    assert by_name["fc"]["params"] == {"fc/W": [512, 64], "fc/b": [64]}
    assert by_name["conv1"]["options"]["filters"] == 16
    shapes = Net(cfg.model).param_shapes()
    assert net["param_count"] == sum(int(np.prod(s)) for s in shapes.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@draws
def test_svg_and_the_cli(tmp_path, capsys):
    out = tmp_path / "deep" / "net.svg"
    assert main(["graph", str(CNN), "-o", str(out), "--set", "name=renamed"]) == 0
    assert out.read_text().lstrip().startswith("<?xml") and "<svg" in out.read_text()
    assert json.loads((tmp_path / "deep" / "net.json").read_text())["name"] == "renamed"
    assert f"wrote {out}" in capsys.readouterr().out


def test_a_drawing_must_be_png_or_svg(tmp_path, capsys):
    assert main(["graph", str(CNN), "-o", str(tmp_path / "net.pdf")]) == 2
    assert "the drawing must be .png or .svg" in capsys.readouterr().err
    assert not (tmp_path / "net.json").exists()


@draws
def test_residual_connections_are_in_the_json_and_drawn_as_arrows(tmp_path):
    cfg = config.load(CNN.with_name("charlm.yaml"))
    js, svg = write_graph(cfg, tmp_path / "net.svg")
    by_name = {ly["name"]: ly for ly in json.loads(js.read_text())["layers"]}
    assert by_name["b1.res1"]["options"]["from"] == ["pos", "b1.attn"]
    assert by_name["b1.res1"]["output_shape"] == [128, 128]
    text = svg.read_text()
    assert "sum of pos + b1.attn" in text
    # one arrow per residual skip besides the chain's: pos -> b1.res1, then each block's two
    assert text.count("#3b6fd1") >= 8


def test_the_json_alone_needs_no_matplotlib(tmp_path):
    """In a Python where matplotlib cannot be imported: ``-o NAME.json`` writes the JSON; a
    drawing is refused, naming what to install and the JSON-only way, and nothing is written."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # import matplotlib now fails
        "from raysinga.cli import main\n"
        f"sys.exit(main(['graph', {str(CNN)!r}, '-o', sys.argv[1]]))"
    )

    def graph(out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120
        )

    run = graph(tmp_path / "net.json")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "net.json").read_text())["name"] == "digits-cnn"
    run = graph(tmp_path / "other" / "net.png")
    assert run.returncode != 0
    assert "raysinga graph needs matplotlib to draw: pip install matplotlib" in run.stderr
    assert f"-o {tmp_path / 'other' / 'net.json'} writes the JSON alone" in run.stderr
    assert not (tmp_path / "other").exists()
