"""Benchmarks and measurement scripts (run from the repository root; see README.md)."""
