"""A runner's output is drained whatever its lines look like: a reader that stops reading
would let the pipe fill and block the runner for good."""

from __future__ import annotations

import asyncio
import sys

from corral.core.spec import RunnerSpec
from corral.runtime.runner import MAX_LINE, Runner, _lines


def test_lines_are_cut_not_fatal() -> None:
    async def run() -> list[str]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"first\n" + b"x" * 300_000 + b"\nafter\n")
        reader.feed_data(b"y" * 200_000)  # a long last line split across reads, no newline
        reader.feed_data(b"z" * 100_000 + b"\nlast")
        reader.feed_eof()
        return [line async for line in _lines(reader)]

    lines = asyncio.run(run())
    assert lines[0] == "first" and lines[2] == "after" and lines[-1] == "last"
    assert lines[1] == "x" * MAX_LINE + " [...]"
    assert lines[3] == "y" * MAX_LINE + " [...]" and len(lines) == 5


def test_a_runner_whose_output_cannot_be_read_is_killed() -> None:
    """The reader failing (here: the line handler raises) kills the process, so that the
    scheduler sees it exit instead of a runner blocked on a full pipe."""

    async def run() -> int:
        r = Runner("m", RunnerSpec(path="/nonexistent", n_ctx=16, num_parallel=1))
        r.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(60)",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip

        async def broken(text: str, ready: bool) -> None:
            raise RuntimeError("boom")

        r._line = broken  # type: ignore[method-assign]
        assert r.proc.stdout is not None
        await asyncio.wait_for(r._read(r.proc.stdout, ready=False), 10)
        return await asyncio.wait_for(r.proc.wait(), 10)

    assert asyncio.run(run()) == -9
