"""Host memory given back: glibc keeps the space of freed buffers below its mmap threshold in its heap, and a load
that frees one weight-sized float buffer after another (fusing layers, quantizing them as they arrive) would end
with hundreds of MB the process no longer uses but still holds."""

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_memory() -> None:
    """glibc's malloc_trim(0): the heap's free pages back to the system (nothing elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
