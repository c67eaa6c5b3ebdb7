"""The run's record next to its checkpoints: the job as run (``job.resolved.yaml``),
``metrics.jsonl``, the TensorBoard event files and the plots, copied from ``run_dir`` (a local
directory of the driver's node) into ``<checkpoint dir>/record/`` at every commit and at the
end, so that a run whose checkpoints go to shared storage (``s3://``, a cluster filesystem)
leaves its whole record there, as Ray Train's ``storage_path`` does. ``raysinga plot`` reads a
record from there too."""

from __future__ import annotations

from pathlib import Path

from raysinga.checkpoint import storage
from raysinga.checkpoint.storage import Location

RECORD = "record"
RESOLVED_JOB = "job.resolved.yaml"  # the job after --set and the command line's other changes
FILES = (RESOLVED_JOB, "metrics.jsonl", "tensorboard/*", "*.png")


def mirrored(run_dir: Path, root: Location) -> bool:
    """Whether the record is copied: not where the checkpoints lie inside ``run_dir`` (the
    default ``<run_dir>/checkpoints``), where it is already beside them."""
    if not root.local:
        return True
    here, there = run_dir.resolve(), Path(root.path).resolve()
    return here != there and here not in there.parents


def mirror(run_dir: Path, root: Location) -> list[str]:
    """Copy the record's files from ``run_dir`` to ``<root>/record/``, each whole (a reader
    sees an older copy or the new one), and remove those the run directory no longer has;
    returns the names copied."""
    if not mirrored(run_dir, root):
        return []
    copied = []
    for pattern in FILES:
        for f in sorted(run_dir.glob(pattern)):
            if f.is_file():
                rel = f.relative_to(run_dir).as_posix()
                dest = root.join(RECORD, *rel.split("/"))
                root.fs.create_dir(dest.path.rsplit("/", 1)[0], recursive=True)
                storage.replace_bytes(dest, f.read_bytes())
                copied.append(rel)
    _drop_stale(root.join(RECORD), set(copied))
    return copied


def _drop_stale(record: Location, kept: set[str]) -> None:
    """Remove the files of ``record`` that the run directory no longer has (an event file a
    resumed run started over)."""
    selector = storage.pafs.FileSelector(record.path, recursive=True, allow_not_found=True)
    for info in record.fs.get_file_info(selector):
        rel = info.path[len(record.path) :].lstrip("/")
        if info.type == storage.pafs.FileType.File and rel not in kept:
            record.fs.delete_file(info.path)


def fetch_metrics(uri: str, into: Path) -> Path:
    """The ``metrics.jsonl`` of the record at ``uri`` (a checkpoint directory's URI, its
    ``record/``, or the file itself), copied to ``into``; FileNotFoundError where none."""
    loc = storage.resolve(uri)
    for cand in (loc, loc.join("metrics.jsonl"), loc.join(RECORD, "metrics.jsonl")):
        info = cand.fs.get_file_info(cand.path)
        if info.type == storage.pafs.FileType.File:
            into.mkdir(parents=True, exist_ok=True)
            (into / "metrics.jsonl").write_bytes(storage.read_bytes(cand))
            return into / "metrics.jsonl"
    raise FileNotFoundError(f"{storage.redact(uri)}: no metrics.jsonl there, nor in its record/")
