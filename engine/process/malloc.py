"""glibc's allocator, set for the tick at engine start, and what its heap holds (`heap_bytes`).

Every tick allocates and frees the same large temporaries (the codec's and the talker's activations: several
MiB each on CPU). glibc serves a block above its mmap threshold (at most 32 MiB, adjusted as it goes) with a
fresh mapping and unmaps it on free, and it returns the heap's free top to the system above its trim
threshold (128 KiB): either way the next tick faults the same pages in again, tens of thousands of page faults
a tick. Raising both thresholds keeps those blocks in the heap, reused tick after tick. It is what the
environment variables MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ do, set from inside the process
(`mallopt`), so every way of starting the engine gets it. On anything but glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("chorus.engine.malloc")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
THRESHOLD = 1 << 30  # 1 GiB: any tick temporary stays in the heap (mallopt takes a C int)


def tune_malloc(threshold: int = THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds to `threshold` bytes; whether it took effect (False where the C
    library is not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, threshold) == 1
    if not ok:
        log.warning("the C library refused the allocator settings: ticks may fault their temporaries in anew")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_mallinfo2 = None


def heap_bytes() -> int | None:
    """Bytes the C heap has handed out and not had back (glibc's `mallinfo2`: in use in the heap and in its
    own mappings); None where the C library is not glibc. Beside the resident size it tells live memory from
    memory freed but kept: with the thresholds `tune_malloc` raises, glibc keeps what a burst used."""
    global _mallinfo2
    if _mallinfo2 is None:
        try:
            fn = ctypes.CDLL("libc.so.6").mallinfo2
        except (OSError, AttributeError):
            return None
        fn.restype = _MallInfo2
        _mallinfo2 = fn
    info = _mallinfo2()
    return info.uordblks + info.hblkhd
