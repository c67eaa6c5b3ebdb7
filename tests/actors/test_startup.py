"""A role's start-up imports only what every role uses.

A replaced role's time is its interpreter's start plus its imports (a spare's too: it loads
while the run trains, on the same cores), so a heavy package imported at module level by what a
role imports costs every replacement, and every run its spares' start. ``ml_dtypes`` alone once
cost each role 1.2 s of CPU (it registers its NumPy loops one by one): a lost worker was
replaced in 1.6 s where it had taken 0.3 s. Each role's module is imported here in a fresh
interpreter, as Ray's worker process imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ROLES = ("raysinga.actors.worker", "raysinga.actors.server", "raysinga.actors.stub")

# Imported where they are used, never at a role's start: precision casts, GPUs, tracking,
# plotting, PyTorch interop, compression, the datasets of examples, Ray's libraries.
HEAVY = (
    "ml_dtypes",
    "torch",
    "cupy",
    "nvmath",
    "mlflow",
    "tensorboardX",
    "sklearn",
    "scipy",
    "matplotlib",
    "pandas",
    "zstandard",
    "safetensors",
    "ray.train",
    "ray.tune",
    "ray.data",
)


def loaded_by(module: str) -> list[str]:
    """The modules of HEAVY that importing ``module`` loads, in a fresh interpreter."""
    code = (
        "import json, sys\n"
        f"import {module}\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ROLES)
def test_a_role_imports_no_heavy_package_at_start(module):
    assert loaded_by(module) == [], f"{module} loads them at start; import each where it is used"


def test_the_check_sees_a_heavy_package_where_one_is_imported():
    """The check itself: a module that loads one of them is caught (``ml_dtypes`` is in the
    test extra)."""
    assert "ml_dtypes" in loaded_by("ml_dtypes")
