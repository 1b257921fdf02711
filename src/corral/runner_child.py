"""Runner child process: llama.cpp's native HTTP server (through xllamacpp) for one model.

Started by corral.runner as `python -m corral.runner_child SPEC_JSON`. It prints
`READY http://127.0.0.1:PORT` on stdout once the model is loaded and serving, logs llama.cpp's
output on stderr, and exits when its parent dies: PR_SET_PDEATHSIG covers SIGKILL of the parent
on Linux, and EOF on stdin (the parent holds the other end) covers everything else.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def build_params(spec: dict[str, Any]) -> Any:
    import xllamacpp as x

    p = x.CommonParams()
    p.model.path = spec["path"]
    p.model_alias = {spec["name"]}  # OpenAI responses name the model, not its file path
    p.n_parallel = spec["num_parallel"]
    # llama.cpp splits n_ctx over the slots; Ollama's num_ctx is per request, so multiply.
    p.n_ctx = spec["n_ctx"] * spec["num_parallel"]
    p.n_gpu_layers = spec["n_gpu_layers"]
    p.fit_params = False  # corral decides the layout; llama.cpp must not re-fit behind our books
    p.cache_ram_mib = 0  # the host prompt cache would use memory the scheduler cannot see
    p.port = 0  # the OS picks a free port: no race with other runners
    p.hostnames = ["127.0.0.1"]
    p.endpoint_metrics = True
    p.endpoint_slots = True
    p.n_threads_http = max(4, spec["num_parallel"] + 2)
    if spec.get("embedding"):
        p.embedding = True
        if spec.get("pooling_type") is not None:
            p.pooling_type = spec["pooling_type"]
    if spec.get("main_gpu") is not None:
        p.main_gpu = spec["main_gpu"]
    if spec.get("threads"):
        p.cpuparams.n_threads = spec["threads"]
        p.cpuparams_batch.n_threads = spec["threads"]
    return p


def main() -> None:
    spec = json.loads(sys.argv[1])
    die_with_parent(spec["parent_pid"])
    import xllamacpp as x

    server = x.Server(build_params(spec))  # returns once the model is loaded and listening
    print(f"READY {server.listening_address}", flush=True)
    try:
        while sys.stdin.buffer.read(4096):  # block until the parent closes our stdin
            pass
    except (OSError, KeyboardInterrupt):
        pass
    os._exit(0)  # skip slow teardown of llama.cpp's threads; the OS frees everything


if __name__ == "__main__":
    main()
