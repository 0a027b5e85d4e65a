"""Benchmarks and the demo; run them as scripts, e.g. ``python benchmarks/demo.py``."""
