"""Storage locations: credentials written into a URI are never shown or stored."""

from __future__ import annotations

import pytest

from raysinga.checkpoint.storage import redact, redact_all, redact_text


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("s3://KEY:SECRET@bucket/run", "s3://bucket/run"),
        ("s3://KEY@bucket/run?region=eu", "s3://bucket/run?region=eu"),
        (
            "s3://bucket/run?access_key=K&secret_key=S&session_token=T&scheme=http",
            "s3://bucket/run?access_key=***&secret_key=***&session_token=***&scheme=http",
        ),
        ("gs://bucket/p?Token=abc", "gs://bucket/p?Token=***"),
        ("hdfs://user:pw@namenode:8020/p", "hdfs://namenode:8020/p"),
        (
            "https://acct.blob.core.windows.net/c?sig=xyz&sv=1",
            "https://acct.blob.core.windows.net/c?sig=***&sv=1",
        ),
        ("/local/path/with@sign", "/local/path/with@sign"),
        ("runs/digits", "runs/digits"),
        ("s3://bucket/key@with-at", "s3://bucket/key@with-at"),
    ],
)
def test_a_uri_is_shown_without_its_credentials(uri, shown):
    assert redact(uri) == shown


def test_every_uri_of_a_job_is_redacted_and_nothing_else_changes():
    job = {
        "checkpoint": {"dir": "s3://K:S@b/r", "keep_last": 3},
        "data": {"source": {"kind": "npy", "x": "s3://b/x.npy?secret_key=S"}},
        "layers": [{"name": "fc@1"}],
        "lr": 0.1,
    }
    assert redact_all(job) == {
        "checkpoint": {"dir": "s3://b/r", "keep_last": 3},
        "data": {"source": {"kind": "npy", "x": "s3://b/x.npy?secret_key=***"}},
        "layers": [{"name": "fc@1"}],
        "lr": 0.1,
    }


def test_every_uri_in_a_message_is_shown_without_its_credentials():
    text = (
        "s3://K:S@b/run?region=x: cannot open this location: 'gs://b/x?token=T' "
        "and http://127.0.0.1:8265 (see /tmp/a)"
    )
    assert redact_text(text) == (
        "s3://b/run?region=x: cannot open this location: 'gs://b/x?token=***' "
        "and http://127.0.0.1:8265 (see /tmp/a)"
    )


def test_a_whole_replace_on_a_full_disk_leaves_the_older_content_and_nothing_beside(small_fs):
    import os  # noqa: PLC0415

    import pyarrow.fs as pafs  # noqa: PLC0415

    from raysinga.checkpoint.storage import Location, replace_bytes  # noqa: PLC0415

    target = Location(pafs.LocalFileSystem(), str(small_fs / "lock"))
    replace_bytes(target, b"older")
    with pytest.raises(OSError):  # more than the 2 MiB disk holds
        replace_bytes(target, b"x" * (3 << 20))
    assert (small_fs / "lock").read_bytes() == b"older"
    assert os.listdir(small_fs) == ["lock"]
