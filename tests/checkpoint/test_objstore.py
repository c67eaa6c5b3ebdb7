"""Checkpoints through Ray's object store: zero-copy in another task, a registry that outlives
the job that published, and the fall-back to disk when the object is gone."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from ray import cloudpickle

from raysinga import checkpoint as C
from raysinga.checkpoint import objstore as O

# Ray's workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DTYPES = ["float16", "float32", "float64", "int8", "int64", "uint16", "bool"]


def _load_in_task(refs):
    ck = O.get(refs[0], verify="full")
    return {n: (a.copy(), a.flags.writeable) for n, a in ck.arrays(None).items()}


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.dictionaries(
        st.from_regex(r"[a-z]{1,4}(/[a-z]{1,4}){0,2}", fullmatch=True),
        st.sampled_from(DTYPES).flatmap(
            lambda dt: hnp.arrays(
                dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
            )
        ),
        min_size=1,
        max_size=5,
    )
)
def test_round_trip_through_the_object_store_into_another_task(
    ray_session, tmp_path_factory, tensors
):
    root = tmp_path_factory.mktemp("ck")
    path = C.save(root, 1, tensors, meta={"k": [1, 2]})
    ref = O.put(path)
    got = ray_session.get(ray_session.remote(_load_in_task).remote([ref]))
    assert set(got) == set(tensors)
    for name, a in tensors.items():
        b, writeable = got[name]
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(b, a)
        if a.size:  # a view of the shared object, not a private copy
            assert not writeable


def test_a_corrupt_object_is_refused(ray_session, tmp_path):
    path = C.save(tmp_path, 2, {"w": np.arange(100, dtype=np.float32)})
    files = O.unpack(O.pack(path))  # views into the packed buffer
    shard = files["shard-0.arrow"]
    shard[len(shard) // 2] ^= 0xFF
    with pytest.raises(C.CheckpointError, match=r"shard-0.arrow: checksum mismatch"):
        C.Checkpoint.from_buffers(files, "object x", verify="full")
    with pytest.raises(C.CheckpointError, match="not a packed raysinga checkpoint"):
        O.unpack(np.zeros(100, np.uint8))


def _change_one_value(path, w: np.ndarray, at: int) -> None:
    """Change element ``at`` of ``w`` in its (uncompressed) shard: same size, new value."""
    shard = Path(path) / "shard-0.arrow"
    blob = bytearray(shard.read_bytes())
    i = blob.index(w.tobytes()) + at * w.itemsize
    blob[i : i + w.itemsize] = np.array([-1], w.dtype).tobytes()
    shard.write_bytes(blob)


def test_put_refuses_files_that_do_not_match_their_manifest(ray_session, tmp_path):
    w = np.arange(1000, dtype=np.float32)
    path = C.save(tmp_path, 2, {"w": w, "b": np.ones(3, np.int8)}).path
    _change_one_value(path, w, 123)
    with pytest.raises(C.CheckpointError, match=r"shard-0.arrow: checksum mismatch"):
        C.Checkpoint.open(path, verify="full")  # what the disk path says of it
    for copy in (O.pack, O.put):
        with pytest.raises(C.CheckpointError, match=r"step-2/shard-0.arrow: checksum mismatch"):
            copy(path)


def test_get_with_full_verify_refuses_an_object_corrupted_after_put(ray_session, tmp_path):
    w = np.arange(1000, dtype=np.float32)
    arr = O.pack(C.save(tmp_path, 2, {"w": w}))
    shard = O.unpack(arr)["shard-0.arrow"]  # a view into ``arr``
    i = bytes(shard).index(w.tobytes()) + 123 * w.itemsize
    shard[i : i + w.itemsize] = np.frombuffer(np.array([-1], w.dtype).tobytes(), np.uint8)
    ref = ray_session.put(arr)  # what a put would hold had memory been damaged after the hash
    assert O.get(ref, verify="fast").array("w")[123] == -1  # fast trusts the object's hash
    with pytest.raises(C.CheckpointError, match=r"shard-0.arrow: checksum mismatch"):
        O.get(ref, verify="full")


PUBLISH = textwrap.dedent("""
    import sys, numpy as np, ray
    from raysinga import checkpoint as C
    from raysinga.checkpoint import objstore as O
    ray.init(address=sys.argv[1], log_to_driver=False)
    path = C.save(sys.argv[2], 7, {"w": np.arange(10, dtype=np.float32)})
    if sys.argv[3] == "registry":
        O.publish(path, "job-run")
    else:  # an object owned by this short-lived job, merely registered
        ref = O.put(path)
        ray.get(O.registry().register.remote("lost-run", 7, [ref], str(path), 0))
    print("published")
""")


def publish_from_another_job(ray_session, root, how):
    addr = ray_session.get_runtime_context().gcs_address
    r = subprocess.run(
        [sys.executable, "-c", PUBLISH, addr, str(root), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "published" in r.stdout, r.stderr


def test_the_registry_keeps_a_checkpoint_after_its_job_ends(ray_session, tmp_path):
    publish_from_another_job(ray_session, tmp_path, "registry")
    ck = O.fetch("job-run", 7)
    np.testing.assert_array_equal(ck.array("w"), np.arange(10, dtype=np.float32))
    assert "object" in str(ck.location)  # it came from memory, not from the disk copy
    assert any(e["run"] == "job-run" for e in ray_session.get(O.registry().list.remote()))
    assert ray_session.get(O.registry().delete.remote("job-run", 7))


def test_the_registry_skips_a_checkpoint_pruned_before_it_got_to_it(ray_session, tmp_path):
    reg = O.registry()
    path = C.save(tmp_path, 3, {"w": np.ones(4, np.float32)}).path
    shutil.rmtree(path)
    assert ray_session.get(reg.adopt.remote("pruned-run", 3, str(path))) == []
    assert ray_session.get(reg.lookup.remote("pruned-run")) is None
    # a damaged one is still an error
    path = C.save(tmp_path, 4, {"w": np.ones(4, np.float32)}).path
    (Path(path) / "manifest.msgpack").write_bytes(b"not a manifest")
    with pytest.raises(ray_session.exceptions.RayTaskError, match="manifest"):
        ray_session.get(reg.adopt.remote("pruned-run", 4, str(path)))


def test_the_registry_has_a_checkpoint_packed_on_the_node_that_sees_it(ray_session, tmp_path):
    # A registry on another machine than the run's may not mount its directory: a task on the
    # caller's node packs it, owned by the registry. (One node here: a node id of no node, and
    # the soft affinity lands on this one, through the same path.)
    reg, elsewhere = O.registry(), "ab" * 28
    path = C.save(tmp_path, 5, {"w": np.arange(6, dtype=np.float32)}).path
    refs = ray_session.get(reg.adopt.remote("packed-run", 5, str(path), elsewhere))
    assert len(refs) == 1
    entry = ray_session.get(reg.lookup.remote("packed-run"))
    assert entry["step"] == 5 and entry["nbytes"] > 0
    np.testing.assert_array_equal(O.fetch("packed-run").array("w"), np.arange(6, dtype=np.float32))
    assert ray_session.get(reg.delete.remote("packed-run", 5))
    shutil.rmtree(path)  # pruned before the task got to it
    assert ray_session.get(reg.adopt.remote("packed-run", 5, str(path), elsewhere)) == []
    assert ray_session.get(reg.lookup.remote("packed-run")) is None


def test_a_lost_object_falls_back_to_the_disk_copy(ray_session, tmp_path):
    publish_from_another_job(ray_session, tmp_path, "owned-by-job")
    # The owner (that job) is gone, so the object goes too, once Ray has noticed the death;
    # until then the fetch may still be served from memory. Either way the data is right.
    deadline = time.monotonic() + 60
    while True:
        ck = O.fetch("lost-run", 7)
        np.testing.assert_array_equal(ck.array("w"), np.arange(10, dtype=np.float32))
        if str(ck.location).endswith("step-7"):
            break
        assert time.monotonic() < deadline, "the object of a dead owner never went away"
        del ck  # its arrays are views that would keep the object in this node's store
        gc.collect()
        time.sleep(0.5)
