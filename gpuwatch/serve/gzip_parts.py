"""A gzipped body compressed only where it changed since the last one.

Most of a /metrics body is the same from one poll to the next: on a node of idle GPU processes
everything but the daemon's own counters; on a training node at least every process's start
time and most of its GPU memory. gzip.compress reads all of it again at every render (zlib's
level 1, after a poll's idle second, takes 0.4-0.5 ms for the 58 KiB body of 64 GPU processes,
1.2-2 ms for the 550 KiB of 1,024). Here the body comes in parts (a family each), gathered into
groups of at least GROUP_BYTES, and each group is deflated on its own, as pigz deflates its
blocks: ended by a full flush (byte-aligned, and nothing after it refers back to it), so that
deflated groups end to end, closed by a final empty block, are one deflate stream. A group
whose text is that of a group of the last body (same length, same 64-bit keyed hash) takes that
group's deflate again. The result is one ordinary gzip member that any inflater reads
(Prometheus's Go reader, GNU gzip, Python's zlib); only the trailer's CRC-32 is computed over
the whole body at every render.

The cost in size: a group's references cannot reach back into the group before it. With groups
of 4 KiB the body of 64 GPU processes is 9% larger gzipped (7.7 to 8.4 KiB); one group per
family would make it 67% larger, the many small families compressing badly alone.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Iterator, Sequence

#: The smallest group of parts deflated on its own (a part this large is a group of its own).
GROUP_BYTES = 4096
#: A window of 4 KiB and a hash table of 2**12 entries, not zlib's 32 KiB and 2**15: a group
#: repeats the label names of the line before it, a few hundred bytes back, which the small window
#: finds as well (the body of 64 GPU processes: 8,459 bytes gzipped against 8,434), and the
#: deflater's state is 20 KiB instead of 256 KiB. Made after each poll, on caches gone cold, the
#: large one cost page faults and cache misses: 14 KiB deflated in 184 us instead of 267.
WINDOW_BITS = 12
MEM_LEVEL = 5
#: What ends a deflate stream: an empty final block (fixed Huffman codes, end-of-block alone).
_FINAL_BLOCK = b"\x03\x00"
#: A group's text as a key: its length and its keyed hash (Python's SipHash, whose key another
#: process cannot know, so nobody can make two texts collide on purpose).
_Print = tuple[int, int]


def _header(level: int) -> bytes:
    """gzip's header as gzip.compress writes it, with no modification time (a body's bytes
    depend on its text alone)."""
    xfl = 4 if level == 1 else 2 if level == 9 else 0
    return b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + bytes((xfl, 255))


def groups(parts: Sequence[bytes], least: int = GROUP_BYTES) -> Iterator[bytes]:
    """`parts` gathered in order into groups of at least `least` bytes (the last one may be
    smaller); a part of `least` or more is a group of its own, so a large family's group does
    not move when a small one before it changes size."""
    gathered: list[bytes] = []
    size = 0
    for part in parts:
        if len(part) >= least:
            if gathered:
                yield b"".join(gathered)
                gathered, size = [], 0
            yield part
            continue
        gathered.append(part)
        size += len(part)
        if size >= least:
            yield b"".join(gathered)
            gathered, size = [], 0
    if gathered:
        yield b"".join(gathered)


class PartsGzip:
    """Gzips bodies made of parts, keeping each group's deflate for the next body. Thread-safe:
    what it keeps is replaced whole, at the end of each body."""

    def __init__(self, level: int = 1, least: int = GROUP_BYTES) -> None:
        self.level = level
        self.least = least
        self._header = _header(level)
        self._kept: dict[_Print, bytes] = {}
        self._lock = threading.Lock()
        #: Bytes of text deflated afresh / taken from the last body (for tests and benches).
        self.deflated = 0
        self.reused = 0

    def compress(self, parts: Sequence[bytes]) -> bytes:
        """One gzip member whose text is the parts end to end."""
        with self._lock:
            kept = self._kept
        new: dict[_Print, bytes] = {}
        out = [self._header]
        crc = size = deflated = reused = 0
        # One deflater for every group that changed (making one costs as much as deflating a
        # small group); a full flush after each forgets the group before.
        deflater = None
        for group in groups(parts, self.least):
            key = (len(group), hash(group))
            block = kept.get(key) or new.get(key)
            if block is None:
                if deflater is None:
                    deflater = zlib.compressobj(self.level, zlib.DEFLATED, -WINDOW_BITS,
                                                MEM_LEVEL)
                block = deflater.compress(group) + deflater.flush(zlib.Z_FULL_FLUSH)
                deflated += len(group)
            else:
                reused += len(group)
            new[key] = block
            out.append(block)
            crc = zlib.crc32(group, crc)
            size += len(group)
        out.append(_FINAL_BLOCK)
        out.append(struct.pack("<II", crc, size & 0xFFFFFFFF))
        with self._lock:
            self._kept = new
            self.deflated += deflated
            self.reused += reused
        return b"".join(out)
