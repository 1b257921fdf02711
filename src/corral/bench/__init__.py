"""corral's benchmarks: `corral bench [all|proxy|cold|swap|estimates|soak|concurrency|embed|...]
[--quick] [--json PATH] [--write-docs]` (also `python -m corral.bench`, `make bench`).

Every figure in docs/benchmarks.md comes from here. Benchmarks print figures; they are not
pass/fail tests (tests/test_bench_smoke.py runs a tiny version of each so they keep working).

This package imports nothing on import: corral.bench.cold_child runs inside every runner the
cold-start benchmark starts, and must cost no more to start than corral.runtime.runner_child.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks named in `argv` (see `corral bench --help`); the exit status."""
    from corral.bench.harness import main as harness_main

    return harness_main(argv)


__all__ = ["main"]
