"""Truncation service settings (`CTX_` env prefix). It owns no state: NATS is its only dependency."""

from __future__ import annotations

from ctxbuild_platform.settings import ServiceSettings
from pydantic import Field


class Settings(ServiceSettings):
    service_name: str = "truncation"
    blob_put_timeout_s: float = Field(
        5.0, description="a blob put slower than this falls back to the inline excerpt (the turn goes on)")
    blob_put_timeout_per_mib_s: float = Field(
        2.0, description="added to blob_put_timeout_s per MiB of text (large texts take the chunked upload)")
    blob_idle_timeout_s: float = Field(
        10.0, description="a chunked transfer (upload, or a claim's read-back) with no progress this long fails")
    put_concurrency: int = Field(16, description="blob puts in flight per request (entities: one per field)")
    cpu_threads: int = Field(
        2, description="threads for the codec work of large requests (decode, validate, plan, apply, encode), "
                       "so a CPU-heavy step never holds the event loop")
    loop_max_bytes: int = Field(
        256 * 1024, description="requests up to this size with few parts (and no claims) are handled on the "
                                "event loop (cheaper than thread hops); anything larger "
                                "goes to the CPU threads")
    loop_max_parts: int = Field(64, description="…and with at most this many parts")
    gil_switch_interval_s: float = Field(
        0.001, description="sys.setswitchinterval for this process: while a CPU thread runs, the event loop "
                           "gets the GIL back within this time (Python's default is 5 ms)")
    max_claims: int = Field(4, description="claim-check read-backs streamed at once per process")
    claim_inline_max_bytes: int = Field(
        768 * 1024, description="a claimed output that needs no trimming is served in full up to this size; "
                                "larger → `too-large` (it cannot travel in one reply)")
