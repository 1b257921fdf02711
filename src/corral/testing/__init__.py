"""Helpers for tests and benchmarks (synthetic GGUF models)."""
