"""glibc's allocator thresholds for a process that moves blob chunks: the one process-wide tuning kept.

A blob transfer moves chunk-sized buffers (≈1 MiB: socket reads, the NATS parser, message payloads, joins,
hashes' inputs). glibc serves each allocation over its mmap threshold (128 KiB at start) with a fresh mapping that
is page-faulted in and unmapped again; with the thresholds raised, freed chunk buffers are reused from the heap
(up to ``trim_threshold`` of free heap is kept). :class:`~ctxbuild_blobclient.BlobClient` applies it when built
(``tune_reads=False`` opts out): `make bench-blobstore` measures the get ratio against raw S3 over 10% worse
without it in the calling process (see services/blobstore/README.md, "Performance notes"). It is the only
place that does this; `mallopt` is glibc's C API, reached through ctypes and pinned by
``tests/unit/test_blobstore_adapters.py``. A no-op off glibc.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h> parameter numbers


def keep_chunk_buffers_in_heap(mmap_threshold: int = 16 << 20, trim_threshold: int = 64 << 20) -> bool:
    """Raise glibc's mmap and trim thresholds (process-wide). Returns whether both applied (False off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False
