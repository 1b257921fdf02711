"""One runner process per loaded model: spawn, wait until it serves, watch it, stop it.

Two kinds of runner, one interface: llama.cpp's server inside a Python child through xllamacpp
(the default, see runner_child) or a user-supplied `llama-server` binary (CORRAL_LLAMA_SERVER).
Both speak llama.cpp's native HTTP API on a loopback port; the parent reaches it through the
runner's `api` (runtime/runner_api), made once it serves.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import asdict
from typing import Any

import psutil

from corral.core.gguf import split_parts
from corral.core.memreport import Allocation, AllocationParser
from corral.core.options import ngram_mod_lengths, spec_type
from corral.core.spec import Layout, RunnerSpec
from corral.errors import ApiError
from corral.runtime.loadwatch import file_bytes, loaded_bytes
from corral.runtime.runner_api import RunnerAPI
from corral.runtime.runner_errors import OUT_OF_MEMORY

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
# libgomp's threads spin this long at llama.cpp's barriers before they sleep, for a runner
# started beside another CPU runner (`short_spin`): the default long spin burns the cores the
# other needs. Why and the figures: docs/benchmarks.md, "what the misses mean".
GOMP_SPINCOUNT = "3000"
OOM_RETRY_AFTER = 5.0  # seconds: its model is placed anew, with more room, on the next try
MAX_OOM_LINE = 300  # characters of the line that said it ran out of memory, quoted
MAX_LINE = 4096  # characters of one log line kept; the rest is drained and dropped


class RunnerError(Exception):
    """The runner failed to start or died; the message quotes the end of its log."""


class Runner:
    def __init__(
        self,
        name: str,
        spec: RunnerSpec,
        llama_server: str | None = None,
        layout: Layout | None = None,
        slot_save_path: str | None = None,
    ) -> None:
        self.name = name
        self.short_spin = False  # GOMP_SPINCOUNT's short spin; the scheduler decides
        self.spec = spec
        self.llama_server = llama_server
        self.layout = layout or Layout(spec.n_gpu_layers, None, spec.main_gpu)
        # Where llama.cpp's slot save/restore reads and writes (the KV cache directory).
        self.slot_save_path = slot_save_path
        self.base_url = ""
        self.proc: asyncio.subprocess.Process | None = None
        self.api: RunnerAPI | None = None  # its HTTP API, once it serves
        self.started_at = 0.0
        self.load_duration = 0.0  # seconds from spawn to serving
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._readers: list[asyncio.Task[None]] = []
        self._ready: asyncio.Future[str] | None = None
        self.exit_code: int | None = None
        self.stopping = False
        self.stalled: float | None = None  # seconds it did not answer before the watchdog killed it
        self.shutting_down = False  # stopped because the server is exiting
        # llama.cpp's own account of its buffers, read from the load log (see memreport).
        self._alloc = AllocationParser()
        self._load_logged = asyncio.Event()
        # How much of its model the runner has loaded (0..1, see loadwatch) while it loads;
        # 1.0 once it serves, None where it cannot be read.
        self.progress: float | None = None
        # The first line of its output that said a buffer did not fit (runner_errors)
        self.out_of_memory: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def allocation(self) -> Allocation | None:
        """What llama.cpp allocated (weights, KV cache, compute, output; per device), complete
        once start() returned; None if its log did not say (e.g. a llama-server binary too old
        or too new to print it at -lv 4)."""
        return self._alloc.allocation

    def log_tail(self, n: int = 8) -> str:
        lines = [ln for ln in self._tail if ln.strip()]
        return "\n".join(lines[-n:])

    async def why_failed(self, wait: float = 2.0) -> str:
        """Why the runner stopped answering: its process gets a moment to exit, so that its
        exit and last log lines can be quoted."""
        if self.proc is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.wait_exit()), wait)
        return self.failure_message()

    async def failed(self) -> ApiError:
        """A request's error for a runner that stopped answering: a 503 if it ran out of memory
        (its model is booked higher from now on: a retry may be placed where it fits), else a
        500."""
        message = await self.why_failed()
        if self.out_of_memory is not None:
            return ApiError(503, message, retry_after=OOM_RETRY_AFTER)
        return ApiError(500, message)

    def failure_message(self) -> str:
        if self.stalled is not None:
            return (
                f"runner for model '{self.name}' stopped responding for {self.stalled:g}s"
                " and was killed"
            )
        if self.shutting_down:
            return "server is shutting down"
        if self.exit_code is None:
            what = "stopped responding"
        elif self.exit_code == -signal.SIGKILL and not self.stopping:
            # Nothing of corral's sent it: the kernel's OOM killer is the usual sender.
            what = "was killed by signal 9 (SIGKILL: out of memory?)"
        elif self.exit_code < 0:
            what = f"was killed by signal {-self.exit_code}"
        else:
            what = f"exited with code {self.exit_code}"
        if self.out_of_memory is not None:
            what += f": it ran out of memory ({self.out_of_memory})"
        tail = self.log_tail()
        return f"runner for model '{self.name}' {what}" + (
            f"; last log lines:\n{tail}" if tail else ""
        )

    async def start(self, timeout: float) -> None:
        """Spawn the runner and return once it serves requests; RunnerError otherwise."""
        loop = asyncio.get_running_loop()
        self.started_at = time.monotonic()
        self._ready = loop.create_future()
        if self.llama_server:
            port = free_port()
            cmd = self._binary_cmd(port)
            self.base_url = f"http://127.0.0.1:{port}"
        else:
            payload = {
                **asdict(self.spec),
                "n_gpu_layers": self.layout.n_gpu_layers,
                "draft_gpu_layers": self.layout.draft_gpu_layers,
                "main_gpu": self.layout.main_gpu,
                "tensor_split": self.layout.tensor_split,
                "name": self.name,
                "parent_pid": os.getpid(),
                "slot_save_path": slot_dir(self.slot_save_path),
            }
            cmd = [sys.executable, "-m", "corral.runtime.runner_child", json.dumps(payload)]
        self.proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=runner_env(os.environ, self.layout.env, self.short_spin),
            preexec_fn=_runner_preexec,
        )
        if self.shutting_down:  # the server began to stop while it was being spawned
            self.kill_now()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            asyncio.create_task(self._read(self.proc.stdout, ready=not self.llama_server)),
            asyncio.create_task(self._read(self.proc.stderr, ready=False)),
        ]
        watch = asyncio.create_task(self._watch_load())
        try:
            if self.llama_server:
                await asyncio.wait_for(self._poll_health(), timeout)
            else:
                self.base_url = await asyncio.wait_for(self._wait_ready(), timeout)
        except asyncio.TimeoutError:
            await self.stop()
            raise RunnerError(
                f"model '{self.name}' did not load within {timeout:g}s"
                + (f"; last log lines:\n{self.log_tail()}" if self.log_tail() else "")
            ) from None
        except BaseException:
            await self.stop()
            raise
        finally:
            watch.cancel()
        self.progress = 1.0
        self.load_duration = time.monotonic() - self.started_at
        if self.api is None:
            self.api = RunnerAPI(self.base_url, self.failed)

    async def _watch_load(self, interval: float = 0.2) -> None:
        """Keep `progress` up to date until start() returns: the share of the model's files
        (with its projector and adapters) the runner process holds in memory or has read."""
        s = self.spec
        paths = [*map(str, split_parts(s.path)), *([s.projector] if s.projector else []),
                 *(a.path for a in s.adapters), *([s.draft] if s.draft else [])]  # fmt: skip
        paths = list(dict.fromkeys(paths))  # a model may draft for itself
        total, pid = file_bytes(paths), self.pid
        if not total or pid is None:
            return
        while True:
            t0 = time.monotonic()
            n = await asyncio.to_thread(loaded_bytes, pid, paths)
            if n is None:
                return
            # Below 1 until it serves: a warm-up run and the HTTP server come after the weights.
            self.progress = max(self.progress or 0.0, min(0.99, n / total))
            # Reading smaps walks every page mapped so far (~20 ms per GB): a big model's load
            # is watched less often, so the watching takes at most a fifth of a core.
            await asyncio.sleep(max(interval, 4 * (time.monotonic() - t0)))

    def _binary_cmd(self, port: int) -> list[str]:
        s = self.spec
        cmd = [
            self.llama_server or "llama-server",
            "-m", s.path, "--alias", self.name, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(s.n_ctx if s.kv_unified else s.n_ctx * s.num_parallel),
            "-np", str(s.num_parallel),
            "-ngl", str(self.layout.n_gpu_layers), "--cache-ram", "0", "--metrics", "--slots",
            "--fit", "off", "--no-webui",
            # llama.cpp logs its buffer sizes at verbosity 4 (trace); see memreport.
            "-lv", "4",
        ]  # fmt: skip
        if self.slot_save_path:
            cmd += ["--slot-save-path", self.slot_save_path]
        if s.kv_unified:
            cmd.append("--kv-unified")
        if s.kv_cache_type != "f16":
            cmd += ["-ctk", s.kv_cache_type, "-ctv", s.kv_cache_type]
        if s.embedding:
            cmd.append("--embedding")
            if s.pooling_type is not None:
                cmd += [
                    "--pooling",
                    {0: "none", 1: "mean", 2: "cls", 3: "last"}.get(s.pooling_type, "mean"),
                ]
        if self.layout.main_gpu is not None:
            cmd += ["-mg", str(self.layout.main_gpu)]
        if self.layout.tensor_split:
            cmd += ["-ts", ",".join(f"{x:g}" for x in self.layout.tensor_split)]
        if s.threads:
            cmd += ["-t", str(s.threads)]
        if s.projector:
            cmd += ["--mmproj", s.projector]
            if self.layout.n_gpu_layers == 0:  # as runner_child: on a GPU only with the layers
                cmd.append("--no-mmproj-offload")
        if s.adapters:
            cmd += ["--lora-scaled", ",".join(f"{a.path}:{a.scale:g}" for a in s.adapters)]
        if s.n_batch:
            cmd += ["-b", str(s.n_batch), "-ub", str(s.n_batch)]
        if s.use_mlock:
            cmd.append("--mlock")
        if s.use_mmap is False:
            cmd.append("--no-mmap")
        if s.flash_attn != "auto":
            cmd += ["-fa", s.flash_attn]
        if s.n_cpu_moe:
            cmd += ["--n-cpu-moe", str(s.n_cpu_moe)]
        if s.chat_template:
            cmd += ["--jinja", "--chat-template", s.chat_template]
        if s.speculative != "off":
            cmd += ["--spec-type", spec_type(s.speculative)]
        if s.draft:  # the draft model, on the target's devices (placement's share of them)
            cmd += ["--spec-draft-model", s.draft]
            if self.layout.draft_gpu_layers is not None:
                cmd += ["-ngld", str(self.layout.draft_gpu_layers)]
        if s.speculative == "ngram-mod":  # its own lengths (corral's, or draft_max/draft_min)
            match, least, most = ngram_mod_lengths(s.draft_max, s.draft_min)
            cmd += ["--spec-ngram-mod-n-match", str(match), "--spec-ngram-mod-n-min", str(least),
                    "--spec-ngram-mod-n-max", str(most)]  # fmt: skip
        else:
            if s.draft_max is not None:
                cmd += ["--spec-draft-n-max", str(s.draft_max)]
            if s.draft_min is not None:
                cmd += ["--spec-draft-n-min", str(s.draft_min)]
        return cmd

    async def _read(self, stream: asyncio.StreamReader, ready: bool) -> None:
        """Drain one of the runner's pipes to its end, line by line. Read in chunks, not with
        readline(): a line past readline's limit (llama.cpp logs a client's 100 KB field on one
        line) would kill the reader, the pipe would fill, and the runner would block for good.
        A reader that fails anyway takes the runner with it, so it cannot hang half-alive."""
        try:
            async for text in _lines(stream):
                await self._line(text, ready)
        except Exception:
            log.exception("reading the output of the runner for '%s' failed; killing it", self.name)
            self.kill_now()

    async def _line(self, text: str, ready: bool) -> None:
        if ready and text.startswith("READY ") and self._ready and not self._ready.done():
            # The child logged its load (stderr, another pipe) before READY: let that reader
            # catch up so that `allocation` is complete when start() returns.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._load_logged.wait(), 2.0)
            self._ready.set_result(text.split(" ", 1)[1])
            return
        self._alloc.feed(text)
        if self._alloc.done:
            self._load_logged.set()
        self._tail.append(text)
        if self.out_of_memory is None and OUT_OF_MEMORY.search(text):
            self.out_of_memory = text.strip()[:MAX_OOM_LINE]
        log.debug("[%s] %s", self.name, text)

    async def _wait_ready(self) -> str:
        assert self._ready is not None and self.proc is not None
        exited: asyncio.Future[Any] = asyncio.ensure_future(self.proc.wait())
        ready: asyncio.Future[Any] = self._ready
        try:
            done, _ = await asyncio.wait({ready, exited}, return_when="FIRST_COMPLETED")
            if ready in done:
                return self._ready.result()
            await self._drain_logs()
            self.exit_code = exited.result()
            raise RunnerError(self.failure_message())
        finally:
            if not exited.done():
                exited.cancel()

    async def _poll_health(self) -> None:
        assert self.proc is not None
        self.api = RunnerAPI(self.base_url, self.failed)
        while await self.api.health(5.0) != 200:
            if self.proc.returncode is not None:
                await self._drain_logs()
                self.exit_code = self.proc.returncode
                raise RunnerError(self.failure_message())
            await asyncio.sleep(0.05)

    async def _drain_logs(self) -> None:
        # The process is gone; give the readers a moment to collect its last words.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._readers), 1.0)

    async def wait_exit(self) -> int:
        """Wait for the process to end (for any reason) and record why."""
        assert self.proc is not None
        code = await self.proc.wait()
        await self._drain_logs()
        self.exit_code = code
        return code

    async def stop(self, grace: float = 3.0) -> None:
        """Ask the runner to exit (close stdin, SIGTERM), SIGKILL after `grace` seconds."""
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                if proc.stdin:
                    proc.stdin.close()
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        # Only now: closing our end first would leave a stream still reading from it (at
        # server shutdown) with aiohttp's bare RuntimeError instead of a broken response.
        if self.api is not None:
            await self.api.close()

    async def wait_gone(self, poll: float = 0.1) -> None:
        """Wait until the process is gone (exited, or a zombie whose memory is free), also when
        asyncio's wait on it has failed: used where watching the runner went wrong."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(proc.wait()), 1.0)
            return
        while True:
            try:
                if psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE:
                    return
            except psutil.NoSuchProcess:
                return
            self.kill_now()
            await asyncio.sleep(poll)

    def kill_now(self) -> None:
        """Kill the process at once (at interpreter exit, or when its output cannot be read);
        whoever waits on it sees it exit."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """The lines of a stream, each cut to MAX_LINE characters (the rest of a longer line is
    dropped unread into memory), until EOF."""
    buf = b""
    skipping = False  # inside a line already cut
    while chunk := await stream.read(65536):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not skipping:
                yield line[:MAX_LINE].decode(errors="replace").rstrip()
            skipping = False
        if len(buf) > MAX_LINE:
            if not skipping:
                yield buf[:MAX_LINE].decode(errors="replace").rstrip() + " [...]"
            skipping, buf = True, b""
    if buf and not skipping:
        yield buf[:MAX_LINE].decode(errors="replace").rstrip()


def runner_env(
    base: Mapping[str, str], layout: Iterable[tuple[str, str]] = (), short_spin: bool = False
) -> dict[str, str]:
    """A runner's environment: corral's, with what every runner needs and its layout's
    (CUDA_VISIBLE_DEVICES: the GPUs booked). GGML_NO_BACKTRACE: a llama.cpp abort must exit at
    once, not wait on gdb for a trace. With `short_spin`, GOMP_SPINCOUNT's spin, unless the
    user set how OpenMP threads wait."""
    env = dict(base)
    if short_spin and "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    return {**env, "PYTHONUNBUFFERED": "1", "GGML_NO_BACKTRACE": "1", **dict(layout)}


def slot_dir(path: str | None) -> str | None:
    """A directory as llama.cpp's slot_save_path wants it: it prefixes file names with it as
    is, so it must end with a separator (its --slot-save-path parser adds one; CommonParams
    does not)."""
    if not path:
        return None
    return path if path.endswith(os.sep) else path + os.sep


def free_port() -> int:
    """A loopback port free right now (for a llama-server binary, which cannot report one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _runner_preexec() -> None:
    """Runs in the runner between fork and exec. Its own process group, so that Ctrl-C in
    the terminal goes to corral, which stops the runners; but not its own session: with the
    kernel's autogroup scheduling (on by default on most distributions) every session is a
    CPU group that gets a fair share as a whole, and a busy runner held to its group's share
    spins llama.cpp's thread barriers against itself (two busy runners on 2 cores answered
    3-80x slower each in their own sessions, 4x in corral's). And SIGKILL when corral dies,
    even by SIGKILL."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
