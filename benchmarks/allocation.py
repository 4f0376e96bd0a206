"""What a CPU step's temporaries cost in time: fresh pages from the C library.

XLA's CPU runtime allocates a compiled program's temporaries each time the program
runs, with the C library's ``malloc``. glibc serves a request above its mmap
threshold (adjusted as memory is freed, at most 32 MiB on 64-bit Linux) with newly
mapped pages, which the kernel zero-fills on their first touch: a step with 40 MB of
temporaries (4 bytes per parameter at 10M parameters) faults in about 10,000 pages
every time it runs, and one with 20 MB reuses the heap's memory after its first run.
The cost is the allocator's, not the arithmetic's, and it is what separates a step
whose temporaries are a few bytes per parameter from one whose are none on this
machine.

:func:`reuse_freed_memory` raises glibc's mmap and trim thresholds for this process
(what the environment variables ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` set at start-up), so that freed temporaries stay in the
heap and the next step reuses them; a benchmark can time its variants both ways.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Large enough for any step's temporaries these benchmarks compile.
_THRESHOLD = 1 << 30


def reuse_freed_memory() -> bool:
    """Keep freed memory in glibc's heap from now on (this process only).

    Returns whether it took effect: ``False`` where the C library is not glibc
    (macOS, musl), whose allocators are left as they are.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)
    )
