"""The command line as a user runs it: a real subprocess."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from raysinga.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[2]


raysinga = run_cli


def test_train_prints_progress_and_final_accuracy(tmp_path):
    r = raysinga(
        "train",
        str(ROOT / "examples/digits_mlp.yaml"),
        "--set",
        "train_steps=60",
        "--set",
        "disp_freq=20",
        "--set",
        f"run_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "step 20/60" in r.stdout and "step 60/60  test_loss" in r.stdout
    assert "final test accuracy: 0." in r.stdout
    assert (tmp_path / "metrics.jsonl").is_file()


def test_an_unreachable_cluster_is_one_line_at_once(tmp_path):
    """Ray would retry an address nothing answers at for ever; the CLI says so and stops."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = raysinga(
        "train",
        str(ROOT / "examples/digits_mlp.yaml"),
        *("--address", f"127.0.0.1:{port}", "--set", f"run_dir={tmp_path}"),
        cwd=tmp_path,
    )
    assert r.returncode == 1
    assert r.stderr.strip() == (
        f"raysinga: error: cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused "
        "(is `ray start --head` running there? --address and RAY_ADDRESS take the head's "
        "host:port)"
    )
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_job_file_is_one_line_and_exit_2(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        (ROOT / "examples/digits_mlp.yaml").read_text().replace("batch_size: 64", "batch_size: -64")
    )
    r = raysinga("train", str(job), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "raysinga: error: data.batch_size: expected an integer >= 1, got -64"
    ]
    assert "Traceback" not in r.stderr


def _edit(path: list, value):
    """The example job with one value replaced (``...`` deletes the key)."""

    def edit(d: dict) -> dict:
        cur = d
        for k in path[:-1]:
            cur = cur[k]
        if value is ...:
            del cur[path[-1]]
        else:
            cur[path[-1]] = value
        return d

    return edit


MALFORMED = {  # a job-file edit -> the start of its one-line error
    "not a mapping": (lambda d: [1, 2], "(top level): expected a mapping"),
    "no model": (_edit(["model"], ...), "model: missing"),
    "unknown key": (_edit(["epochs"], 3), "epochs: unknown key"),
    "negative steps": (_edit(["train_steps"], -5), "train_steps: expected an integer >= 1"),
    "steps as text": (_edit(["train_steps"], "ten"), "train_steps: expected an integer >= 1"),
    "zero batch": (_edit(["data", "batch_size"], 0), "data.batch_size: expected an integer"),
    "data not a mapping": (_edit(["data"], 5), "data: expected a mapping"),
    "data typo": (_edit(["data", "shuffel"], True), "data: unknown key(s) ['shuffel']"),
    "layers not a list": (_edit(["model", "layers"], "dense"), "model.layers: expected"),
    "negative units": (_edit(["model", "layers", 1, "units"], -3), "model.layers[1]: layer"),
    "layer option typo": (
        _edit(["model", "layers", 1, "unitz"], 3),
        "model.layers[1]: layer 'fc2'",
    ),
    "unknown layer": (_edit(["model", "layers", 1, "kind"], "capsule"), "model.layers[1].kind"),
    "lr as text": (_edit(["updater", "lr"], "fast"), "updater.lr: a learning-rate schedule"),
    "unknown optimizer": (_edit(["updater", "name"], "adamax"), "updater: unknown optimizer"),
    "zero servers": (_edit(["topology", "n_servers"], 0), "topology.n_servers: expected"),
    "negative cpus": (_edit(["topology", "worker"], {"cpus": -1}), "topology.worker.cpus"),
    "workers as text": (_edit(["topology", "workers_per_group"], "two"), "topology.workers"),
    "negative keep": (_edit(["checkpoint"], {"keep_last": -1}), "checkpoint.keep_last"),
    "failures as text": (_edit(["fault"], {"max_failures": "x"}), "fault.max_failures"),
    "elastic minimum": (_edit(["fault"], {"min_workers": 5}), "fault.min_workers: 5 is more"),
    "init typo": (_edit(["init"], {"renames": {"a": "b"}}), "init: unknown key(s) ['renames']"),
    "init rename": (_edit(["init"], {"rename": {"a": 3}}), "init.rename: expected names"),
    "init prefix": (_edit(["init"], {"strip_prefix": 2}), "init.strip_prefix: expected"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_every_malformed_job_file_gets_one_line_naming_the_key(tmp_path, case, capsys):
    import copy

    import yaml

    from raysinga.cli import main

    edit, want = MALFORMED[case]
    job = yaml.safe_load((ROOT / "examples/digits_mlp.yaml").read_text())
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(edit(copy.deepcopy(job))))
    assert main(["train", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"raysinga: error: {want}"), err


def test_broken_yaml_is_one_line_with_its_position(tmp_path, capsys):
    from raysinga.cli import main

    (tmp_path / "job.yaml").write_text("model: {input_shape: [64]\nlayers: - x\n")
    assert main(["train", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"raysinga: error: \S*job\.yaml:2:1: not valid YAML: .+\n", err), err


def test_help_lists_train():
    r = raysinga("--help", cwd=ROOT)
    assert r.returncode == 0 and "train" in r.stdout


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_stops_a_distributed_run(tmp_path):
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "raysinga.cli",
            "train",
            str(ROOT / "examples/digits_mlp.yaml"),
            "--set",
            "train_steps=1000000",
            "--set",
            f"run_dir={tmp_path}",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a shell's background jobs ignore SIGINT; a user's terminal does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step"):
            break
    p.send_signal(signal.SIGINT)
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, "".join(lines) + out
    last = out.rstrip().splitlines()[-1]
    m = re.fullmatch(
        r"raysinga: stopped by SIGINT at step (\d+); checkpoint (\S+); continue with --resume", last
    )
    assert m, out
    ck = Checkpoint.open(m.group(2), verify="full")
    assert ck.step == int(m.group(1)) > 0 and m.group(2).endswith(f"step-{ck.step}")


@pytest.mark.parametrize(
    "flags",
    [
        ["--resume", "--auto-resume"],
        ["--auto-resume", "--fresh"],
        ["--resume", "--init-from", "runs/x/checkpoints/step-1"],
        ["--auto-resume", "--init-from", "runs/x/checkpoints/step-1", "--fresh"],
    ],
    ids=lambda f: " ".join(x for x in f if x.startswith("--")),
)
def test_start_options_given_together_are_refused_by_name(tmp_path, flags, capsys):
    from raysinga.cli import main

    job = ROOT / "examples/digits_mlp.yaml"
    assert main(["train", str(job), "--set", f"run_dir={tmp_path / 'run'}", *flags]) == 2
    err = capsys.readouterr().err
    named = " and ".join(x for x in flags if x.startswith("--"))
    assert err.startswith(f"raysinga: error: {named} were given together"), err
    assert not (tmp_path / "run").exists()


def test_a_checkpoints_directory_given_for_one_names_its_newest_valid_step(tmp_path, capsys):
    import numpy as np

    from raysinga.checkpoint import save
    from raysinga.cli import main

    root = tmp_path / "run" / "checkpoints"
    for step in (10, 20, 30):
        save(str(root), step, {"w": np.full(1000, step, np.float32)})
    shard = next((root / "step-30").glob("shard-*.arrow"))
    shard.write_bytes(shard.read_bytes()[:100])  # the newest is truncated
    for given in (root, root.parent):
        assert main(["inspect", str(given)]) == 1  # a checkpoint error, as for a bad one
        err = capsys.readouterr().err
        assert err.startswith(
            f"raysinga: error: {given}: not a checkpoint but holds some; the newest valid is "
            f"{root / 'step-20'}; newer step-30 is not valid ("
        ), err
    (root / "step-10" / "shard-0.arrow").unlink()
    (root / "step-20" / "shard-0.arrow").unlink()
    assert main(["inspect", str(root)]) == 1
    assert "none of its step-N is valid" in capsys.readouterr().err


def test_init_from_with_renames_on_the_command_line(tmp_path, capsys):
    import numpy as np
    import yaml

    from raysinga.cli import main

    job = yaml.safe_load((ROOT / "examples/digits_mlp.yaml").read_text())
    job["model"]["layers"][0]["name"] = "hidden"  # fc1 of the checkpoint, renamed here
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    first = ["train", str(ROOT / "examples/digits_mlp.yaml"), "--local"]
    first += ["--set", "train_steps=5", "--set", f"run_dir={tmp_path / 'a'}"]
    assert main(first) == 0
    src = tmp_path / "a" / "checkpoints" / "step-5"
    again = ["train", str(tmp_path / "job.yaml"), "--local", "--set", "updater.lr=0.0"]
    again += ["--set", "train_steps=1", "--set", f"run_dir={tmp_path / 'b'}"]
    assert main([*again, "--rename", "fc1/=hidden/"]) == 2
    assert "--rename and --strip-prefix go with --init-from" in capsys.readouterr().err
    assert main([*again, "--init-from", str(src), "--rename", "fc1"]) == 2
    assert "--rename fc1: expected OLD=NEW" in capsys.readouterr().err
    assert main([*again, "--init-from", str(src), "--rename", "fc1/=hidden"]) == 2
    assert "a prefix (ending in '/') renames to a prefix" in capsys.readouterr().err
    assert main([*again, "--init-from", str(src), "--rename", "fc1/=hidden/"]) == 0
    assert "matched 6, missing 0, unexpected 0" in capsys.readouterr().out
    a = Checkpoint.open(src)
    b = Checkpoint.open(tmp_path / "b" / "checkpoints" / "step-1")
    np.testing.assert_array_equal(b.array("hidden/W"), a.array("fc1/W"))
    kept = yaml.safe_load((tmp_path / "b" / "job.resolved.yaml").read_text())  # as run
    assert kept["init"] == {"rename": {"fc1/": "hidden/"}, "strip_prefix": None}
