"""Ray's own messages about the run's processes, in the run's ``ray.log`` instead of on the
driver's console.

Ray prints on the console of every driver what its raylets report about the job's processes: a
role's process that died ("A worker died or was killed while executing a task ..."), one the
OOM killer ended. A loss the run recovers from is already one line of raysinga's, and its
recovery another; Ray's account of it is kept beside the run's other records, in
``<run_dir>/ray.log``, each line with the time it came. The roles' own output (what a user's
layer prints) still reaches the console as Ray forwards it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FILE = "ray.log"


@contextlib.contextmanager
def kept_in(run_dir: Path) -> Iterator[Path]:
    """Meanwhile, Ray's messages about the job's processes go to ``run_dir``/ray.log (created
    with the first). Where Ray prints them elsewhere than this hook reaches (its internals
    moved), they stay on the console. Yields the file's path."""
    path = Path(run_dir) / FILE
    try:
        from ray._private import worker as ray_worker  # noqa: PLC0415

        original = ray_worker.print_to_stdstream
    except (ImportError, AttributeError):
        yield path
        return

    def route(data: dict[str, Any], ignore_prefix: bool) -> None:
        # Ray's driver prints the raylets' error messages under the pid "raylet"; the roles'
        # output comes with their pids, through a handler bound to Ray's own printer
        if data.get("pid") != "raylet":
            original(data, ignore_prefix)
            return
        with contextlib.suppress(OSError):  # a full disk: the message is lost, not the run
            path.parent.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            with open(path, "a") as f:
                f.writelines(f"{stamp} (raylet) {line}\n" for line in data.get("lines", []))

    ray_worker.print_to_stdstream = route
    try:
        yield path
    finally:
        if ray_worker.print_to_stdstream is route:
            ray_worker.print_to_stdstream = original
