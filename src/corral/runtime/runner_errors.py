"""llama.cpp's errors as the client's: a runner's refusal of a request is a 4xx with
llama.cpp's own message (never a 500 for the client's mistake), a shared cache that filled up
is corral's 503 (`CacheFull`), a prompt longer than the context a 400 with its numbers
(`ContextOverflow`), and an error line in a stream is found and read (`stream_error`)."""

from __future__ import annotations

import re
from typing import Any

import orjson

from corral.errors import ApiError

# A line of llama.cpp's output that says a buffer did not fit: in system memory (a failed
# allocation, bad_alloc) or on a GPU (CUDA and HIP print "CUDA error: out of memory" before
# ggml-cuda.cu's abort, or "cudaMalloc failed"; Vulkan ErrorOutOfDeviceMemory), at load or at a
# later compute. Read from every line a runner prints (Runner.out_of_memory), not its last few:
# an abort's backtrace comes after it.
OUT_OF_MEMORY = re.compile(
    r"out of memory|failed to allocate|unable to allocate|(?:cuda|hip)Malloc(?:Host)? failed"
    r"|bad_alloc|OutOfDeviceMemory|OutOfHostMemory",
    re.I,
)

# llama.cpp's answer to a batch that no longer finds room in the KV cache (update_slots), sent
# to every slot then processing; and, where slots draft (speculative decoding), what it throws
# for a slot whose drafts the retry in halves splits (llama.cpp #24840: the same full cache)
CACHE_FULL = "context size has been exceeded"
CACHE_FULL_SPLIT = "is not inside the current sub-batch"


def is_cache_full(message: str) -> bool:
    """Whether llama.cpp's error message says the slots' shared cache is full."""
    low = message.lower()
    return CACHE_FULL in low or CACHE_FULL_SPLIT in low


def runner_error_message(body: bytes, status: int) -> str:
    return _runner_error(body, status)[0]


SSE_ERROR = b'data: {"error":'


def stream_error(out: bytes) -> str | None:
    """The message of the last `error: {...}` line or `data: {"error": ...}` event (llama.cpp's)
    in `out`, a stream's whole events, if any."""
    if b"error: " not in out and SSE_ERROR not in out:  # the common case, without splitting
        return None
    error = None
    for line in out.split(b"\n"):
        if (line := line.strip()).startswith(b"error: "):
            error = runner_error_message(line[7:], 500)
        elif line.startswith(SSE_ERROR):
            error = runner_error_message(line[6:], 500)
    return error


def stream_failure(message: str) -> ApiError:
    """llama.cpp's error that ended a stream, as the client's: a full shared cache is a 503
    (clients retry it: Anthropic's overloaded_error), anything else the runner's 500."""
    return CacheFull(message) if is_cache_full(message) else ApiError(500, message)


class CacheFull(ApiError):
    """llama.cpp found no room in a runner's KV cache for a request's next batch: the slots
    share one cache (kv_unified) and the requests running at once outgrew it. Not the
    client's doing: a 503."""

    def __init__(self, message: str) -> None:
        super().__init__(
            503, f"the context this model's requests share is full ({message.rstrip('.')}): "
            "other requests held it; try again when they have ended",
        )  # fmt: skip


class ContextOverflow(ApiError):
    """llama.cpp refused a prompt longer than its context (`exceed_context_size_error`): a 400
    with its message, and the prompt's tokens and the context (per slot) it did not fit."""

    def __init__(self, message: str, prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(400, message)
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


def _runner_error(body: bytes, status: int) -> tuple[str, str, dict[str, Any]]:
    """llama.cpp's error message and type (invalid_request_error, server_error, ...), and the
    error object itself ({} if none)."""
    try:
        data = orjson.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message") if isinstance(err, dict) else err
        kind = err.get("type") if isinstance(err, dict) else None
        if msg:
            return str(msg), str(kind or ""), err if isinstance(err, dict) else {}
    except orjson.JSONDecodeError:
        pass
    text = body.decode(errors="replace").strip()
    return text or f"runner answered HTTP {status}", "", {}


# llama.cpp's error types that blame the request, whatever HTTP status came with them.
_CLIENT_ERROR_TYPES = {
    "invalid_request_error": 400, "exceed_context_size_error": 400, "not_supported_error": 400,
    "not_found_error": 404, "unavailable_error": 503,
}  # fmt: skip
# llama.cpp answers some of a client's own mistakes with 500 (an exception thrown while it
# parses the request): these words in the message say the request was at fault.
_CLIENT_FAULT = re.compile(
    r"failed to parse|json\.exception|too large to process|exceeds the available context"
    r"|context size has been exceeded|grammar|schema|invalid|unsupported|not supported"
    r"|missing|expected|must be|cannot use|unknown|field '",
    re.IGNORECASE,
)


def runner_error(body: bytes, status: int) -> ApiError:
    """A runner's non-200 answer as the client's error: llama.cpp's refusals of the request
    itself are 4xx (never 500), with llama.cpp's message."""
    msg, kind, err = _runner_error(body, status)
    if is_cache_full(msg):
        return CacheFull(msg)
    if kind == "exceed_context_size_error":
        tokens, n_ctx = err.get("n_prompt_tokens"), err.get("n_ctx")
        if isinstance(tokens, int) and isinstance(n_ctx, int):
            return ContextOverflow(msg, tokens, n_ctx)
    code = _CLIENT_ERROR_TYPES.get(kind)
    if code is None:
        if 400 <= status < 500 or status == 503:
            code = status
        elif _CLIENT_FAULT.search(msg):
            code = 400
        else:
            code = 500
    return ApiError(code, msg)
