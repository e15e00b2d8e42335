"""release_free_memory: glibc's malloc_trim where it exists, a no-op elsewhere."""

import platform
import sys

from quantkit.memory import release_free_memory


def test_release_free_memory_uses_glibc_where_present():
    bufs = [bytearray(1 << 20) for _ in range(64)]
    del bufs
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert release_free_memory() is glibc
