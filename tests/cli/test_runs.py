"""`raysinga runs`: the runs under a directory, and the object-store registry's entries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raysinga.checkpoint import objstore, save
from raysinga.cli import main
from raysinga.cli.runs import drop, registry_entries


def test_runs_lists_each_runs_checkpoints_newest_valid_and_size(tmp_path, capsys):
    for run, at in (("a", (10, 20)), ("b", (5,))):
        for step in at:
            save(str(tmp_path / run / "checkpoints"), step, {"w": np.zeros(1 << 18, np.float32)})
    (tmp_path / "notes").mkdir()  # not a run: left out
    shard = next((tmp_path / "a" / "checkpoints" / "step-20").glob("shard-*.arrow"))
    shard.write_bytes(b"cut")  # a damaged newest: the newest valid is 10
    assert main(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "checkpoints", "newest", "valid", "size", "set", "aside"]
    assert lines[1].split()[:4] == ["a", "2", "10", "1.0"]
    assert lines[2].split()[:4] == ["b", "1", "5", "1.0"]
    assert main(["runs", str(tmp_path / "b"), "--json"]) == 0  # one run directory
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["run"], row["checkpoints"], row["newest_valid"]) == ("b", 1, 5)
    assert main(["runs", str(tmp_path), "--drop", "x@y"]) == 2
    assert "--drop and --step go with --registry" in capsys.readouterr().err
    assert main(["runs", str(tmp_path / "nothing")]) == 2
    assert "no such directory of runs" in capsys.readouterr().err


def test_the_registry_lists_and_drops_entries(ray_session, tmp_path):
    path = save(str(tmp_path / "ck"), 3, {"w": np.arange(100, dtype=np.float32)})
    key = f"listed-run@{tmp_path / 'ck'}"
    objstore.publish(str(path), key)
    (entry,) = [e for e in registry_entries() if e["run"] == key]
    assert (entry["step"], entry["in_memory"], entry["uri"]) == (3, True, str(path))
    assert drop(key, step=4) == []
    assert drop(key) == [3]
    assert not [e for e in registry_entries() if e["run"] == key]
    with pytest.raises(Exception, match="no checkpoint of run"):
        objstore.fetch(key)
