"""Helpers for tests and benchmarks: tiny checkpoints made locally (no downloads)."""
