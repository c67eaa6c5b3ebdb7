"""A raysinga checkpoint read from docs/checkpoint-format.md alone: NumPy, pyarrow, msgpack and
xxhash, no raysinga. Every checksum the format holds is checked (the manifest's, each file's, each
slice's, the model spec's digest), then every tensor is returned whole.

    python examples/read_checkpoint.py runs/digits-mlp/checkpoints/step-1500

prints each tensor's name, kind, shape and dtype. tests/examples/test_read_checkpoint.py holds
this reader to raysinga's own loader, bit for bit, on checkpoints of many kinds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys

import msgpack
import numpy as np
import pyarrow as pa
import xxhash

VERSION = 1  # the format version this reader knows
SCHEMA = pa.schema(  # every column nullable, the list's child named "item", no metadata
    [("name", pa.string()), ("kind", pa.string()), ("start", pa.int64()), ("stop", pa.int64())]
    + [("shape", pa.list_(pa.int64())), ("dtype", pa.string()), ("version", pa.int64())]
    + [("data", pa.large_binary())]
)
DTYPES = "float16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool".split()
ENTRY = ("name", "kind", "shape", "dtype", "start", "stop", "version")  # repeated in the shard


class Corrupt(ValueError):
    """The directory is not a whole, unaltered checkpoint of the known version."""


def _check(ok: object, why: str) -> None:
    if not ok:
        raise Corrupt(why)


_xxh3 = xxhash.xxh3_64_hexdigest


def _unpack(data: bytes, what: str) -> dict:
    try:
        out = msgpack.unpackb(data, raw=False)
    except Exception as e:  # noqa: BLE001 - any undecodable bytes are the same verdict
        raise Corrupt(f"{what} does not decode: {e}") from None
    _check(isinstance(out, dict), f"{what} is not a map")
    return out


def read_manifest(path: str) -> dict:
    """The manifest body of the checkpoint directory ``path``, its checksum and version checked."""
    with open(os.path.join(path, "manifest.msgpack"), "rb") as f:
        outer = _unpack(f.read(), "manifest.msgpack")
    body = outer.get("body")
    _check(isinstance(body, bytes) and _xxh3(body) == outer.get("xxh3"), "manifest checksum")
    m = _unpack(body, "manifest body")
    _check(m.get("format") == "raysinga-checkpoint", "not a raysinga checkpoint")
    _check(m.get("version") == VERSION, f"format version {m.get('version')!r}, not {VERSION}")
    return m


def read_checkpoint(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest body, {tensor name: whole array}) of the checkpoint directory ``path``."""
    m = read_manifest(path)
    blobs = {}
    for f in m["files"]:
        _check(re.fullmatch(r"shard-\d+\.arrow|params\.meta", f["file"]), f"file {f['file']!r}")
        with open(os.path.join(path, f["file"]), "rb") as fh:
            blobs[f["file"]] = data = fh.read()
        _check(len(data) == f["size"], f"{f['file']}: {len(data)} bytes, not {f['size']}")
        _check(_xxh3(data) == f["xxh3"], f"{f['file']}: checksum")
    _check_meta_text(blobs["params.meta"].decode(), m["tensors"])
    pieces: dict[tuple[str, int], bytes] = {}
    for name, data in blobs.items():
        if name.startswith("shard-"):
            pieces.update(_read_shard(int(name[6:-6]), data, m["tensors"]))
    _check(len(pieces) == len(m["tensors"]), "slices missing from the shards")
    arrays = {t["name"]: _assemble(t, m["tensors"], pieces) for t in m["tensors"]}
    run = m["meta"].get("run")
    if run is not None:  # the model digest: SHA-256 of the spec's canonical JSON
        spec = json.dumps(run["model"]["spec"], sort_keys=True, separators=(",", ":"))
        _check(hashlib.sha256(spec.encode()).hexdigest() == run["model"]["digest"], "digest")
    return m, arrays


def _check_meta_text(text: str, tensors: list[dict]) -> None:
    """params.meta repeats the manifest's entries, one tab-separated line each."""
    lines = text.split("\n")
    _check(lines[0].startswith("#") and lines[-1] == "", "params.meta layout")
    want = [
        "\t".join(
            [t["name"], t["kind"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"]]
            + [f"{t['start']}:{t['stop']}", str(t["version"]), f"shard-{t['shard']}"]
            + [f"xxh3:{t['xxh3']}"]
        )
        for t in tensors
    ]
    _check(sorted(lines[1:-1]) == sorted(want), "params.meta disagrees with the manifest")


def _read_shard(k: int, data: bytes, tensors: list[dict]) -> dict[tuple[str, int], bytes]:
    """The slices of shard ``k``: one record batch each, agreeing with its manifest entry."""
    entries = {(t["name"], t["start"]): t for t in tensors if t["shard"] == k}
    try:
        r = pa.ipc.open_file(pa.py_buffer(data))
        batches = [r.get_batch(i) for i in range(r.num_record_batches)]
        for b in batches:
            b.validate(full=True)
    except (pa.ArrowException, OSError) as e:
        raise Corrupt(f"shard-{k}.arrow: {e}") from None
    _check(r.schema.equals(SCHEMA) and str(r.schema) == str(SCHEMA), f"shard-{k}: schema")
    _check(r.schema.metadata is None, f"shard-{k}: schema metadata")
    _check(len(batches) == len(entries), f"shard-{k}: {len(batches)} record batches")
    out = {}
    for b in batches:
        _check(b.num_rows == 1, f"shard-{k}: a record batch of {b.num_rows} rows")
        row = {c: b.column(c)[0].as_py() for c in SCHEMA.names}
        t = entries.get((row["name"], row["start"]))
        _check(t is not None and (row["name"], row["start"]) not in out, f"shard-{k}: a record")
        _check(all(row[c] == t[c] for c in ENTRY), f"shard-{k}: {row['name']} differs")
        _check(t["dtype"] in DTYPES, f"dtype {t['dtype']!r}")
        size = (t["stop"] - t["start"]) * np.dtype(t["dtype"]).itemsize
        _check(len(row["data"]) == size, f"{t['name']}: {len(row['data'])} bytes, not {size}")
        _check(_xxh3(row["data"]) == t["xxh3"], f"{t['name']}[{t['start']}:]: checksum")
        out[(row["name"], row["start"])] = row["data"]
    return out


def _assemble(t: dict, tensors: list[dict], pieces: dict[tuple[str, int], bytes]) -> np.ndarray:
    """The tensor ``t`` names, from its slices: sorted by start they tile [0, size) exactly."""
    mine = sorted((s for s in tensors if s["name"] == t["name"]), key=lambda s: s["start"])
    size, stop = int(np.prod(t["shape"], dtype=np.int64)), 0
    for s in mine:
        same = all(s[c] == t[c] for c in ("kind", "shape", "dtype"))
        _check(same and s["start"] == stop, f"{t['name']}: slices do not tile it")
        stop = s["stop"]
    _check(stop == size, f"{t['name']}: slices do not tile it")
    raw = b"".join(pieces[(s["name"], s["start"])] for s in mine)
    dtype = np.dtype(t["dtype"]).newbyteorder("<")  # little-endian on every machine
    return np.frombuffer(raw, dtype).astype(t["dtype"]).reshape(t["shape"])


if __name__ == "__main__":
    manifest, tensors = read_checkpoint(sys.argv[1])
    print(f"step {manifest['step']}: {len(tensors)} tensors, every checksum verified")
    kinds = {t["name"]: t["kind"] for t in manifest["tensors"]}
    for name, a in tensors.items():
        print(f"  {name:32s} {kinds[name]:5s} {str(a.shape):16s} {a.dtype}")
