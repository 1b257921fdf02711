"""corral.runtime.runner_child with timestamps, for the cold-start benchmark's direct side.

Run as `python -m corral.bench.cold_child SPEC_JSON`: it runs corral.runtime.runner_child.main()
unchanged, having wrapped xllamacpp.Server to print `MARK <phase> <time.monotonic()>` lines on
stdout around the model load. CLOCK_MONOTONIC is system-wide on Linux, so the parent can place
the marks on its own clock. `"bench_warmup": false` in the spec turns llama.cpp's warm-up run
off, to measure the load without it.
"""

from __future__ import annotations

import time

T_MAIN = time.monotonic()  # the interpreter is up (before any heavy import)

import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402


def mark(phase: str, t: float | None = None) -> None:
    print(f"MARK {phase} {time.monotonic() if t is None else t:.6f}", flush=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    warmup = bool(spec.pop("bench_warmup", True))
    sys.argv[1] = json.dumps(spec)
    mark("main", T_MAIN)
    import xllamacpp

    from corral.runtime import runner_child

    mark("imported")
    real_server = xllamacpp.Server

    def timed_server(params: Any, *args: Any, **kwargs: Any) -> Any:
        if not warmup:
            params.warmup = False
        mark("load_start")
        server = real_server(params, *args, **kwargs)
        mark("load_end")
        return server

    xllamacpp.Server = timed_server
    runner_child.main()


if __name__ == "__main__":
    main()
