"""Storage every node can reach, checked before any role starts (raysinga/cluster/reach.py):
on hosts that share nothing but a network, a local ``checkpoint.dir`` or data file that only
the driver's host has is refused in one line, and the same job trains with its checkpoints on
a directory every host mounts and its data on S3."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import S3_BUCKET, S3_KEYS

from raysinga.cluster import reach

JOB = """
name: reach
seed: 2
model:
  input_shape: [64]
  layers:
    - {{kind: dense, name: fc1, units: 32, activation: relu}}
    - {{kind: dense, name: out, units: 10}}
data: {{source: {source}, batch_size: 64}}
updater: {{name: sgd, lr: 0.05, momentum: 0.9}}
train_steps: 150
disp_freq: 50
test_freq: 150
checkpoint_frequency: 50
topology: {{preset: sandblaster, n_servers: 1, workers_per_group: 2}}
"""


def digits_tables() -> tuple[pa.Table, pa.Table]:
    """scikit-learn's digits as (train, test) tables of a ``x`` list column and ``y``."""
    from sklearn.datasets import load_digits  # noqa: PLC0415

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)

    def table(rows: slice) -> pa.Table:
        cells = pa.FixedSizeListArray.from_arrays(pa.array(x[rows].reshape(-1)), 64)
        return pa.table({"x": cells, "y": pa.array(y[rows].astype(np.int64))})

    return table(slice(0, 1500)), table(slice(1500, None))


@pytest.fixture(scope="module")
def cluster(module_lab):
    """A head that trains nothing (the driver runs there), a 2-CPU host, both seeing the
    lab's shared directory, and an S3 server on a host of its own."""
    import hosts  # noqa: PLC0415

    head, node = hosts.ray_cluster(module_lab, [1, 2])
    endpoint = module_lab.s3(module_lab.host("s3"))
    return head, node, endpoint


def train(head, job: str, *sets: str):
    head.path("/mnt/job.yaml").write_text(job)
    args = ["raysinga", "train", "/mnt/job.yaml", "--address", f"{head.address}:6379"]
    return head.run([*args, *(x for s in sets for x in ("--set", s))], timeout=600)


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("raysinga: error:")]


@pytest.mark.cluster
def test_a_checkpoint_dir_only_the_drivers_host_has_is_refused_before_any_role(cluster):
    head, node, _ = cluster
    r = train(head, JOB.format(source="{kind: digits}"), "run_dir=/mnt/run")
    assert r.returncode == 2, r.stdout
    (line,) = error_lines(r.stdout)
    assert "checkpoint.dir /mnt/run/checkpoints" in line and f"node {node.address}" in line
    assert "mount one filesystem at that path on every node" in line and "s3://" in line
    assert "Traceback" not in r.stdout and "training" not in r.stdout
    assert not head.path("/mnt/run").exists(), "nothing of the run is written"
    assert [p.name for p in head.path("/mnt").iterdir() if p.name.startswith(".raysinga")] == []


@pytest.mark.cluster
def test_a_data_file_one_host_lacks_is_refused_and_the_same_data_on_s3_trains(cluster):
    import pyarrow.fs as pafs  # noqa: PLC0415

    head, node, endpoint = cluster
    tables = digits_tables()
    for t, name in zip(tables, ("train", "test"), strict=True):
        pq.write_table(t, head.path(f"/mnt/digits-{name}.parquet"))
    files = "path: /mnt/digits-train.parquet, test: {path: /mnt/digits-test.parquet}"
    local = f"{{kind: parquet, {files}}}"
    r = train(head, JOB.format(source=local), "run_dir=/mnt/shared/local-data")
    assert r.returncode == 2, r.stdout
    (line,) = error_lines(r.stdout)
    assert "data file /mnt/digits-train.parquet" in line and f"node {node.address}" in line
    assert "is not there" in line and "s3://" in line

    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                           allow_bucket_creation=True, **S3_KEYS)  # fmt: skip
    fs.create_dir(S3_BUCKET)
    for t, name in zip(tables, ("train", "test"), strict=True):
        with fs.open_output_stream(f"{S3_BUCKET}/digits-{name}.parquet") as f:
            pq.write_table(t, f)
    keys = f"{S3_KEYS['access_key']}:{S3_KEYS['secret_key']}"
    query = f"endpoint_override={endpoint}&scheme=http&region=us-east-1"

    def uri(name: str) -> str:
        return f"s3://{keys}@{S3_BUCKET}/digits-{name}.parquet?{query}"

    remote = f"{{kind: parquet, path: '{uri('train')}', test: {{path: '{uri('test')}'}}}}"
    r = train(head, JOB.format(source=remote), "run_dir=/mnt/shared/s3-data")
    assert r.returncode == 0, r.stdout
    assert float(r.stdout.split("final test accuracy: ")[1].split()[0]) > 0.85, r.stdout
    assert node.path("/mnt/shared/s3-data/checkpoints/step-150").is_dir()


def test_local_data_files_are_those_of_both_splits_and_uris_are_left_alone(tmp_path):
    src = {"kind": "npy", "x": "x.npy", "y": "y.npy", "test": {"x": "tx.npy"}}
    got = reach.local_data_files(src)
    assert [p.rsplit("/", 1)[1] for p in got] == ["x.npy", "y.npy", "tx.npy"]
    assert reach.local_data_files({"kind": "digits"}) == []
    uri = "s3://bucket/d.parquet?endpoint_override=x"
    assert reach.local_data_files({"kind": "parquet", "path": uri}) == []


def test_a_single_node_checks_nothing(ray_session, tmp_path):
    # a path no node could see: on one node there is nothing to compare with
    reach.check(str(tmp_path / "nowhere" / "checkpoints"), [])
    assert list(tmp_path.iterdir()) == []
