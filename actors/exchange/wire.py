"""What gradients and values cross between roles as (``topology.wire``), and a block's sum.

With ``topology.reduce: hosts`` the workers of each block (``workers_per_host`` of them, placed
on one host) are summed by the block's first worker, its leader, in worker order; the blocks'
sums of each server's slices meet at that server, which sums them in block order. So the order
of every addition is fixed by the job, not by where Ray placed the blocks: two runs give the
same bits, on one host or on many.

``wire: bf16`` rounds each block's sum and each server's published values to bfloat16 (to
nearest, ties to even) before they leave their role, and a reader on the same node as the
server rounds the values it reads alike: the bits do not depend on which reads crossed a link.
The servers keep float32 values and optimizer state, and sum the blocks in float32.

``wire: f32+zstd`` and ``bf16+zstd`` send the same words compressed (:func:`.squeeze.squeeze`):
lossless, so every bit is as under ``f32`` or ``bf16``, in fewer bytes on a slow link, for the
time it takes both ends to compress and decompress them. A server sends a reader that holds
its values of one update earlier the difference of the words (:func:`delta_frame`), which is
mostly zeros and compresses to about half its bytes, where a sum of gradients compresses to
about 0.85. ``wire: f32+delta`` and ``bf16+delta`` compress only those differences and send
the sums as they are: on a faster link, where compressing the sums costs the hosts' cores more
time than it saves the link, the values still cross in about half their bytes.

Both cross in parts (:func:`parts_of`, the last layers' first): a server sums, updates and
pushes the values of each part as soon as every block's sum of it is in, while the next parts
are still on their way, so that the sums and the values share the links instead of taking
turns; a block of one worker sends each part as soon as its backward pass has finished it.
Each element is summed, updated and rounded as it would be in one piece: the parts change no
bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from raysinga.kernels.precision import bf16_bits, from_bf16_bits, round_bf16

from ..common.buffers import Layout
from .squeeze import Squeezed, squeeze

PART_BYTES = 256 << 10  # float32 bytes of a server's slices in one part, at most
TAIL_BYTES = 32 << 10  # the smallest part the last one sent is halved down to (float32 bytes)

Span = tuple[str, int, int]  # an entry's name and a flat range [start, stop) of it


def parts_of(layout: Layout, part_bytes: int | None = None) -> list[list[Span]]:
    """``layout``'s arrays (a server's slices, in its order) cut into parts of equal element
    counts, the fewest of at most ``part_bytes`` (default :data:`PART_BYTES`) float32
    bytes each; each part lists its flat ranges of the arrays, in order. The parts run from
    the layout's end to its start: a server's slices follow the model's parameters, whose
    last layer's gradients a backward pass finishes first, so a worker can send the first
    parts while it computes the rest (:class:`.worker_side.EarlySends`). A pure function of
    its inputs: a server and the nodes it sends to agree on it without a word.

    The part sent last is halved, and its second half again, down to parts of
    :data:`TAIL_BYTES`: a server updates a part and sends its values back once every block's
    is in, so what is left to cross after the last gradients is the last part's values. A
    link busy to the end of a step then carries one small part's values after its last
    gradients, not a whole part's."""
    part_bytes = PART_BYTES if part_bytes is None else part_bytes
    sizes = [(e.name, math.prod(e.shape)) for e in layout.entries]
    total = sum(n for _, n in sizes)
    count = max(1, -(-total * 4 // part_bytes))
    bounds = [total * i // count for i in range(count + 1)]
    n = bounds[1]  # the layout's first part, sent last: halved from its start
    while n * 4 // 2 >= TAIL_BYTES:
        n //= 2
        bounds.insert(1, n)
    parts: list[list[Span]] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        spans, off = [], 0
        for name, n in sizes:
            a, b = max(lo - off, 0), min(hi - off, n)
            if a < b:
                spans.append((name, a, b))
            off += n
        parts.append(spans)
    return parts[::-1]


def cut(arrays: dict[str, np.ndarray], part: Sequence[Span]) -> list[np.ndarray]:
    """The flat ranges of ``part`` of ``arrays`` (by name): views."""
    return [arrays[name].reshape(-1)[a:b] for name, a, b in part]


def words(wire: str) -> str:
    """What ``wire`` sends each element as: ``"f32"`` or ``"bf16"`` (compressed or not)."""
    return wire.split("+")[0]


def squeezed(wire: str) -> bool:
    """Whether ``wire`` compresses every array that crosses TCP connections (``+zstd``)."""
    return wire.endswith("+zstd")


def deltas(wire: str) -> bool:
    """Whether a server sends a reader that holds its previous values the difference from
    them, compressed (:func:`delta_frame`): ``+zstd`` and ``+delta``."""
    return wire.endswith(("+zstd", "+delta"))


def wire_bytes(layout: Layout, wire: str) -> int:
    """The bytes of float32 arrays laid out by ``layout`` as they cross under ``wire``, before
    any compression."""
    n = sum(e.nbytes for e in layout.entries)
    return n if words(wire) == "f32" else n // 2


def encode(arrays: Sequence[np.ndarray], wire: str) -> list[np.ndarray]:
    """Float32 ``arrays`` as their words cross under ``wire``: as they are (Ray copies each
    into its object store once, as it puts the list), or rounded to bfloat16 words."""
    if words(wire) == "f32":
        return list(arrays)
    return [bf16_bits(a) for a in arrays]


def frame(arrays: Sequence[np.ndarray], wire: str) -> list[np.ndarray | Squeezed]:
    """Float32 ``arrays`` as a TCP frame carries them under ``wire``: :func:`encode`'s words,
    compressed where ``wire`` says (:func:`.squeeze.squeeze`)."""
    out = encode(arrays, wire)
    return [squeeze(a) for a in out] if squeezed(wire) else out


def decode(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Float32 arrays from what :func:`encode` made: views where float32 already, exact
    conversions of bfloat16 words."""
    return [from_bf16_bits(a) if a.dtype == np.uint16 else a for a in arrays]


# What a push of a server's values carries, in its frames' epoch field (a push has no epoch of
# its own): the values, or the difference of their words from the reader's previous version.
WHOLE, DELTA = 0, 1


def delta_frame(
    arrays: Sequence[np.ndarray], before: Sequence[np.ndarray], wire: str
) -> list[Squeezed]:
    """Float32 ``arrays`` as the difference of the words that cross under ``wire`` from those
    of ``before`` (the same ranges one update earlier), bit by bit (exclusive or), compressed:
    an update changes few of a value's leading bits, so the difference is mostly zeros. A
    reader that holds ``before``'s words gets ``arrays``' back exactly (:func:`apply_delta`)."""
    out = []
    for new, old in zip(encode(arrays, wire), encode(before, wire), strict=True):
        bits = np.uint32 if new.dtype == np.float32 else np.uint16
        diff = np.bitwise_xor(new.view(bits), old.view(bits))
        out.append(squeeze(diff.view(new.dtype)))
    return out


def apply_delta(dst: np.ndarray, delta: np.ndarray, base: np.ndarray | None = None) -> None:
    """A reader's float32 ``dst`` (the words that crossed one update earlier, decoded; or,
    given, ``base``'s, which are left as they are) moved on by one :func:`delta_frame` array
    ``delta`` (float32 bits, or bfloat16 words)."""
    bits = dst.view(np.uint32)
    if delta.dtype == np.uint16:  # a bfloat16 word is a float32's upper half
        delta = delta.astype(np.uint32) << 16
    was = bits if base is None else base.view(np.uint32)
    np.bitwise_xor(was, delta.view(np.uint32), out=bits)


def rounded(values: dict[str, np.ndarray], wire: str) -> dict[str, np.ndarray]:
    """``values`` as a reader gets them under ``wire``: as they are (``f32``), or rounded to
    bfloat16 (new float32 arrays)."""
    if words(wire) == "f32":
        return values
    return {k: round_bf16(v) for k, v in values.items()}


def blocks(n_workers: int, per_block: int) -> list[list[int]]:
    """The workers of each block, in order: ``[[0, 1], [2, 3]]`` for 4 workers by 2."""
    return [list(range(b, min(b + per_block, n_workers))) for b in range(0, n_workers, per_block)]
