"""The blob store's use cases: the only place that combines the domain with the adapters."""

from .blobs import BlobStore, Config
from .gc import Collector, GcReport, gc_loop

__all__ = ["BlobStore", "Collector", "Config", "GcReport", "gc_loop"]
