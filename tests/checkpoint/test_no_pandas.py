"""Writing a checkpoint imports no pandas: pyarrow imports it, where it is installed, as soon as
it converts Python values (``pa.array``, ``from_pylist``), which cost each server half a second
of CPU as it wrote its first checkpoint, in the middle of training. The shard's bytes are the
format's (tests/checkpoint/test_format.py and the rest of the suite read them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_a_shard_and_its_commit_are_written_without_importing_pandas(tmp_path):
    pytest.importorskip("pandas")  # (nothing to show where it is not installed)
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from raysinga.checkpoint import Checkpoint, TensorInfo, begin, commit, write_shard

        w = np.arange(12, dtype=np.float32).reshape(3, 4)
        for compression in (None, "zstd"):
            loc = begin({str(tmp_path)!r} + "/" + str(compression), 5)
            info = TensorInfo("w", "param", (3, 4), "float32", 0, 12)
            path = commit(loc, 5, [write_shard(loc, 0, [(info, w)], compression)]).path
            assert (Checkpoint.open(path).arrays("param")["w"] == w).all()
        print("pandas" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False", "writing a checkpoint imported pandas"
