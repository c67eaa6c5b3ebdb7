"""The run's record beside its checkpoints when they lie outside the run directory."""

from __future__ import annotations

from raysinga.checkpoint.storage import resolve
from raysinga.run.record import mirror, mirrored


def test_the_record_is_copied_only_where_the_checkpoints_lie_elsewhere(tmp_path):
    run = tmp_path / "run"
    assert not mirrored(run, resolve(run / "checkpoints"))  # the default: already beside
    assert not mirrored(run, resolve(run))
    assert mirrored(run, resolve(tmp_path / "shared" / "ckpts"))


def test_the_copy_follows_the_run_directory(tmp_path):
    run, shared = tmp_path / "run", tmp_path / "shared"
    (run / "tensorboard").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train"}\n')
    (run / "tensorboard" / "events.1").write_bytes(b"one")
    (run / "loss.png").write_bytes(b"png")
    (run / "job.yaml").write_text("not part of the record")
    (run / "job.resolved.yaml").write_text("name: run\n")  # the job as run: part of it
    assert mirror(run, resolve(shared)) == [
        "job.resolved.yaml",
        "metrics.jsonl",
        "tensorboard/events.1",
        "loss.png",
    ]
    (run / "tensorboard" / "events.1").unlink()  # a resumed run started a new event file
    (run / "tensorboard" / "events.2").write_bytes(b"two")
    (run / "metrics.jsonl").write_text('{"kind": "train"}\n{"kind": "eval"}\n')
    mirror(run, resolve(shared))
    got = sorted(
        p.relative_to(shared / "record").as_posix() for p in shared.rglob("*") if p.is_file()
    )
    assert got == ["job.resolved.yaml", "loss.png", "metrics.jsonl", "tensorboard/events.2"]
    assert (shared / "record" / "metrics.jsonl").read_text().count("\n") == 2
