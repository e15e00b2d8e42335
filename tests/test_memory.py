"""quantkit.platform.memory: glibc's malloc_trim where it exists (a no-op elsewhere), and what the peak sampler reads."""

import platform
import sys

import pytest

from quantkit.platform.memory import release_free_memory


def test_release_free_memory_uses_glibc_where_present():
    bufs = [bytearray(1 << 20) for _ in range(64)]
    del bufs
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert release_free_memory() is glibc


def _statm() -> tuple[int, int]:
    import os

    with open("/proc/self/statm") as f:
        pages = f.read().split()
    return int(pages[1]) * os.sysconf("SC_PAGE_SIZE"), int(pages[2]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
def test_the_peak_sampler_says_how_much_of_the_peak_was_file_backed(tmp_path):
    """Memory-mapped checkpoint pages count in resident memory but are not allocations: the sampler reports
    their share of the peak (statm's shared pages), so a benchmark can tell the two apart."""
    import mmap

    import numpy as np

    from quantkit.platform.memory import PeakSampler

    path = tmp_path / "pages.bin"
    path.write_bytes(b"\1" * (64 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        _, shared = _statm()
        with PeakSampler(0.001, live=False) as peak:
            int(np.frombuffer(mapped, dtype=np.uint8)[::4096].sum())  # one byte a page: every page mapped
        assert peak.file_at_peak - shared >= 60 << 20
    with mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:  # fresh private pages
        rss, shared = _statm()
        with PeakSampler(0.001, live=False) as anon:
            block[::4096] = b"\1" * (16 << 10)  # written: resident, not file-backed
        assert anon.peak_rss - rss >= 60 << 20 and anon.file_at_peak - shared < 16 << 20
