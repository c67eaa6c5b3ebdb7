"""Job files: valid ones load, malformed ones fail with the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from raysinga import config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GOOD = config.parse_yaml((EXAMPLES / "digits_mlp.yaml").read_text())


def with_(path: str, value):
    d = config.apply_overrides(GOOD, [])
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    if value is None:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return d


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_job_file_loads(name):
    cfg = config.load(EXAMPLES / name)
    assert cfg.train_steps > 0 and cfg.model.layers


@pytest.mark.parametrize(
    "path,value,match",
    [
        ("train_steps", -5, r"^train_steps: expected an integer >= 1, got -5"),
        ("train_steps", "ten", r"^train_steps: expected an integer"),
        ("train_steps", None, r"^train_steps: missing"),
        ("model", None, r"^model: missing"),
        ("seed", 1.5, r"^seed: expected an integer >= 0"),
        ("dtype", "float16", r"^dtype: expected one of float32, float64"),
        ("device", "tpu", r"^device: expected one of auto, cpu, gpu"),
        ("data.batch_size", 0, r"^data.batch_size: expected an integer >= 1"),
        ("data.shuffle", "yes", r"^data.shuffle: expected true or false"),
        ("data.bacth_size", 3, r"^data: unknown key\(s\) \['bacth_size'\]"),
        ("data.source", None, r"^data.source: missing"),
        ("data", [1, 2], r"^data: expected a mapping"),
        ("updater.name", "lbfgs", r"^updater: .*lbfgs"),
        ("updater.momentum", -1, r"^updater: .*momentum"),
        ("updater.clip_norm", 0, r"^updater.clip_norm: expected a positive number"),
        ("model.layers", [], r"^model.layers: expected a non-empty list"),
        ("model.input_shape", [-1], r"^model.input_shape"),
        ("tain_steps", 3, r"^tain_steps: unknown key"),
    ],
)
def test_malformed_values_name_the_key_path(path, value, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(with_(path, value))


def test_overrides_parse_yaml_values_and_refuse_bad_paths():
    d = config.apply_overrides(GOOD, ["updater.lr=1e-3", "train_steps=7", "data.shuffle=false"])
    assert d["updater"]["lr"] == 0.001 and d["train_steps"] == 7 and d["data"]["shuffle"] is False
    assert GOOD["train_steps"] != 7  # the original is untouched
    with pytest.raises(config.ConfigError, match="expected key.path=value"):
        config.apply_overrides(GOOD, ["train_steps"])
    with pytest.raises(config.ConfigError, match="train_steps: is not a mapping"):
        config.apply_overrides(GOOD, ["train_steps.x=1"])


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(config.ConfigError, match="no such job file"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load(bad)
