"""A gzipped /metrics body compressed only where it changed: one ordinary gzip member, whatever
was kept from the body before."""

from __future__ import annotations

import gzip
import random
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.metrics import Registry, choose_encoder
from gpuwatch.metrics.core import Counter
from gpuwatch.serve.exposition import RenderedMetrics
from gpuwatch.serve.gzip_parts import GROUP_BYTES, PartsGzip, groups
from gpuwatch.sinks.exposition_text import Family, LineWriter, row

TEXT, _ = choose_encoder("")


def _family(name: str, rows: int, value: int = 0) -> bytes:
    head = f"# HELP {name} A family.\n# TYPE {name} gauge\n"
    lines = "".join(f'{name}{{pid="{1000 + i}",user="u{i % 7}"}} {value + i}\n'
                    for i in range(rows))
    return (head + lines).encode()


def _one_member(body: bytes) -> bytes:
    """The text of `body`, which must be exactly one gzip member, read by zlib's inflater."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    text = inflater.decompress(body) + inflater.flush()
    assert inflater.eof and inflater.unused_data == b""
    return text


def test_a_body_of_parts_is_one_gzip_member_of_their_text() -> None:
    parts = [_family(f"f{i}", rows) for i, rows in enumerate([1, 3, 200, 2, 0, 40, 1])]
    body = PartsGzip().compress(parts)
    assert _one_member(body) == b"".join(parts)
    assert gzip.decompress(body) == b"".join(parts)


def test_no_parts_is_the_empty_text() -> None:
    assert _one_member(PartsGzip().compress([])) == b""


def test_an_unchanged_group_is_not_deflated_again() -> None:
    gzipper = PartsGzip()
    big = [_family(f"big{i}", 300) for i in range(3)]
    small = [_family(f"small{i}", 2) for i in range(5)]
    first = gzipper.compress([*small, *big])
    assert gzipper.reused == 0
    deflated = gzipper.deflated
    # Only the small families' values move; the large ones come in as new, equal objects.
    moved = [_family(f"small{i}", 2, value=7) for i in range(5)]
    again = [bytes(bytearray(part)) for part in big]
    second = gzipper.compress([*moved, *again])
    assert gzipper.reused == sum(map(len, big))
    assert gzipper.deflated - deflated == sum(map(len, moved))
    assert _one_member(first) == b"".join([*small, *big])
    assert _one_member(second) == b"".join([*moved, *big])


def test_kept_groups_make_a_valid_stream_in_any_order() -> None:
    gzipper = PartsGzip()
    parts = [_family(f"f{i}", rows) for i, rows in enumerate([300, 5, 250, 1, 400, 30, 2])]
    gzipper.compress(parts)
    shuffle = random.Random(7)
    for _ in range(20):
        shuffle.shuffle(parts)
        reused = gzipper.reused
        assert _one_member(gzipper.compress(parts)) == b"".join(parts)
    assert gzipper.reused > reused


def test_a_large_part_is_a_group_of_its_own_and_small_ones_are_gathered() -> None:
    small, large = b"s" * 100, b"L" * GROUP_BYTES
    assert list(groups([small, small, large, small])) == [small * 2, large, small]
    many = [small] * 100
    gathered = list(groups(many))
    assert b"".join(gathered) == small * 100
    assert all(len(g) >= GROUP_BYTES for g in gathered[:-1])


@pytest.mark.skipif(shutil.which("gzip") is None, reason="no gzip tool here")
def test_the_gzip_tool_reads_a_body_made_of_kept_groups(tmp_path: Path) -> None:
    gzipper = PartsGzip()
    parts = [_family(f"f{i}", rows) for i, rows in enumerate([300, 5, 250, 1])]
    gzipper.compress(parts)
    parts[1] = _family("f1", 5, value=9)
    path = tmp_path / "body.gz"
    path.write_bytes(gzipper.compress(parts))
    # GNU gzip inflates with code of its own, not zlib's.
    out = subprocess.run(["gzip", "-dc", str(path)], capture_output=True, check=True).stdout
    assert out == b"".join(parts)


class _Processes:
    """A collector of one large family whose rows do not change, as idle processes show."""

    def __init__(self) -> None:
        self.rows = [row((str(1000 + i), "root"), 2.0**30 + i) for i in range(300)]

    def collect(self) -> Iterator[Family]:
        family = Family("gpu_memory_bytes", "GPU memory.", ("pid", "user"))
        family.extend(self.rows)
        yield family


def test_a_scraped_gzip_body_is_the_text_body_gzipped_poll_after_poll() -> None:
    registry = Registry()
    polls = Counter("polls", "Polls.")
    registry.register(polls)
    registry.register(_Processes())
    rendered = RenderedMetrics(registry, writer=LineWriter().write_parts)
    for n in range(1, 4):
        polls.inc()
        rendered.refresh(1.0)
        for gzipped in (False, True):
            assert rendered.kept(TEXT, gzipped) is None
        text, zipped = rendered.body(TEXT, False), rendered.body(TEXT, True)
        assert _one_member(zipped) == text
        assert f"polls_total {n}.0".encode() in text
        assert text.count(b"gpu_memory_bytes{") == 300
