"""Caller side of the blob store (SPEC §6): inline or chunked puts (claim check), streamed read-back, the
model-facing reads, references. See :class:`BlobClient`."""

from .chunks import Rechunker, digest_str, pieces, str_slices
from .client import ERROR_HEADER, INLINE_MAX_BYTES, OFFSET_HEADER, BlobClient

__all__ = ["ERROR_HEADER", "INLINE_MAX_BYTES", "OFFSET_HEADER", "BlobClient", "Rechunker", "digest_str", "pieces",
           "str_slices"]
