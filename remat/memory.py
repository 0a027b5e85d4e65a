"""Deterministic memory measurement (live tensor storages), used by the benchmarks."""

from ._memory import track as track

__all__ = ["track"]
