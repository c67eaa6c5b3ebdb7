"""The manifest file: sealing it (writer) and opening it (reader), its structure checked.

``manifest.msgpack`` is a msgpack map ``{"body": <msgpack of the manifest>, "xxh3": hex}``: the
manifest carries its own checksum, so a flipped byte in it is caught like one anywhere else,
before anything it says is believed. Opened, it is checked whole, every tensor entry and how the
slices tile each tensor included, so that a reader may rely on it afterwards.
"""

from __future__ import annotations

from typing import Any

import msgpack
import xxhash

from .format import FORMAT_NAME, FORMAT_VERSION, CheckpointError, TensorInfo, check_layout
from .storage import Location

MAX_MANIFEST = 256 << 20


def _fail(loc: Location, why: str) -> CheckpointError:
    return CheckpointError(f"{loc}: {why}")


def seal(manifest: dict[str, Any]) -> bytes:
    """The bytes of the manifest file for ``manifest`` (plain data: msgpack refuses the rest)."""
    try:
        body = msgpack.packb(manifest, use_bin_type=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint metadata must be plain data (msgpack): {e}") from None
    return msgpack.packb({"body": body, "xxh3": xxhash.xxh3_64_hexdigest(body)}, use_bin_type=True)


def unseal(loc: Location, blob: bytes) -> dict[str, Any]:
    """The manifest in ``blob``, the bytes of the manifest file at ``loc`` (named by errors):
    its checksum, format, version and structure checked."""
    try:
        outer = msgpack.unpackb(blob, raw=False, max_bin_len=MAX_MANIFEST, strict_map_key=True)
        body, digest = outer["body"], outer["xxh3"]
        if not isinstance(body, bytes) or not isinstance(digest, str):
            raise TypeError("bad types")
    except Exception as e:  # noqa: BLE001 - any malformed input is the same verdict
        raise _fail(loc, f"not a raysinga manifest ({type(e).__name__})") from None
    if xxhash.xxh3_64_hexdigest(body) != digest:
        raise _fail(loc, "checksum mismatch: the manifest is corrupt")
    try:
        m = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001
        raise _fail(loc, f"manifest body does not decode ({type(e).__name__})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise _fail(loc, "not a raysinga checkpoint manifest")
    v = m.get("version")
    if not isinstance(v, int) or v < 1:
        raise _fail(loc, f"bad format version {v!r}")
    if v > FORMAT_VERSION:
        raise _fail(
            loc,
            f"written in format version {v}, newer than this reader "
            f"({FORMAT_VERSION}); upgrade raysinga to read it",
        )
    _check_structure(loc, m)
    return m


def _check_structure(loc: Location, m: dict[str, Any]) -> None:
    def bad(what: str) -> CheckpointError:
        return _fail(loc, f"malformed manifest: {what}")

    if not isinstance(m.get("step"), int) or m["step"] < 0:
        raise bad("step")
    if not isinstance(m.get("meta"), dict):
        raise bad("meta")
    files = m.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, dict)
        and isinstance(f.get("file"), str)
        and "/" not in f["file"]
        and isinstance(f.get("size"), int)
        and isinstance(f.get("xxh3"), str)
        for f in files
    ):
        raise bad("files")
    tensors = m.get("tensors")
    if not isinstance(tensors, list):
        raise bad("tensors")
    shard_files = {f["file"] for f in files}
    for t in tensors:
        try:
            info = to_info(t)
            info.check()
        except (KeyError, TypeError, ValueError, CheckpointError) as e:
            raise bad(f"tensor entry {t!r:.80} ({e})") from None
        if f"shard-{info.shard}.arrow" not in shard_files:
            raise bad(f"tensor {info.name!r} points to a missing shard {info.shard}")
    try:
        check_layout(to_info(t) for t in tensors)
    except CheckpointError as e:
        raise bad(str(e)) from None


def to_info(t: dict[str, Any]) -> TensorInfo:
    ints = ("start", "stop", "version", "shard")
    if (
        not all(isinstance(t[k], int) for k in ints)
        or not isinstance(t["shape"], list)
        or not all(isinstance(d, int) for d in t["shape"])
    ):
        raise TypeError("integer fields expected")
    return TensorInfo(
        str(t["name"]),
        str(t["kind"]),
        tuple(t["shape"]),
        str(t["dtype"]),
        t["start"],
        t["stop"],
        t["version"],
        t["shard"],
    )
