"""Runner child process: llama.cpp's native HTTP server (through xllamacpp) for one model.

Started by corral.runtime.runner as `python -m corral.runtime.runner_child SPEC_JSON`. It prints
`READY http://127.0.0.1:PORT` on stdout once the model is loaded and serving, logs llama.cpp's
output on stderr, and exits when its parent dies: PR_SET_PDEATHSIG covers SIGKILL of the parent
on Linux, and EOF on stdin (the parent holds the other end) covers everything else.

llama.cpp reports the buffers it allocates (weights, KV cache, compute, output) only at log
verbosity 4, so the load runs at 4; then the log is flushed, memreport.LOADED_MARKER goes to
stderr and the verbosity drops back to llama.cpp's default, which keeps request logs short.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
from typing import Any

from corral.core.estimate import KV_CACHE_TYPES, check_kv_cache_type
from corral.core.memreport import LOADED_MARKER
from corral.core.options import FLASH_ATTN, ngram_mod_lengths, spec_type

PR_SET_PDEATHSIG = 1
LOAD_VERBOSITY = 4  # LLAMA_LOG_INFO maps to verbosity 4 ("trace") in llama.cpp's common log
RUN_VERBOSITY = 3  # llama.cpp's default: server info lines, warnings, errors


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
    if spec.get("kv_unified"):
        # One cache the slots share: each request may use all n_ctx cells (llama.cpp's own
        # default, -np -1, does the same with 4 slots).
        p.kv_unified = True
        p.n_ctx = spec["n_ctx"]
    else:
        # llama.cpp splits n_ctx over the slots; Ollama's num_ctx is per request: multiply.
        p.n_ctx = spec["n_ctx"] * spec["num_parallel"]
    p.n_gpu_layers = spec["n_gpu_layers"]
    p.fit_params = False  # corral decides the layout; llama.cpp must not re-fit behind our books
    p.cache_ram_mib = 0  # the host prompt cache would use memory the scheduler cannot see
    p.port = 0  # the OS picks a free port: no race with other runners
    p.hostnames = ["127.0.0.1"]
    p.endpoint_metrics = True
    p.endpoint_slots = True
    if spec.get("slot_save_path"):  # POST /slots/{id}?action=save|restore read and write here
        p.slot_save_path = spec["slot_save_path"]
    p.n_threads_http = max(4, spec["num_parallel"] + 2)
    p.verbosity = LOAD_VERBOSITY
    kv_type = spec.get("kv_cache_type") or "f16"
    if kv_type not in KV_CACHE_TYPES:
        raise ValueError(
            f"unsupported kv_cache_type {kv_type!r}; use one of {', '.join(KV_CACHE_TYPES)}"
        )
    # Same type for K and V. A quantized V cache needs flash attention, which llama.cpp's
    # default (flash_attn auto) turns on for it, or fails to create the context if it cannot.
    p.cache_type_k = p.cache_type_v = getattr(x.ggml_type, f"GGML_TYPE_{kv_type.upper()}")
    if spec.get("speculative", "off") != "off":  # llama.cpp's --spec-type
        kind = "COMMON_SPECULATIVE_TYPE_" + spec_type(spec["speculative"]).upper().replace("-", "_")
        p.speculative.types = [getattr(x.common_speculative_type, kind)]
    draft = p.speculative.draft
    if spec.get("draft"):  # the draft model, on the target's devices (placement's share)
        draft.mparams.path = spec["draft"]
        if spec.get("draft_gpu_layers") is not None:
            draft.n_gpu_layers = spec["draft_gpu_layers"]
    if spec.get("speculative") == "ngram-mod":  # its own lengths, as the binary's flags
        mod = p.speculative.ngram_mod
        mod.n_match, mod.n_min, mod.n_max = ngram_mod_lengths(
            spec.get("draft_max"), spec.get("draft_min")
        )
    else:
        if spec.get("draft_max") is not None:
            draft.n_max = spec["draft_max"]
        if spec.get("draft_min") is not None:
            draft.n_min = spec["draft_min"]
    if spec.get("embedding"):
        p.embedding = True
        if spec.get("pooling_type") is not None:
            p.pooling_type = spec["pooling_type"]
    if spec.get("main_gpu") is not None:
        p.main_gpu = spec["main_gpu"]
    if spec.get("tensor_split"):
        split = list(p.tensor_split)  # fixed-size array in llama.cpp: one entry per device
        for i, share in enumerate(spec["tensor_split"][: len(split)]):
            split[i] = float(share)
        p.tensor_split = split
    if spec.get("threads"):
        p.cpuparams.n_threads = spec["threads"]
        p.cpuparams_batch.n_threads = spec["threads"]
    if spec.get("projector"):
        p.mmproj.path = spec["projector"]
        # On the first GPU the runner sees when the model has layers on a GPU (that is where
        # placement books it), else in system memory.
        p.mmproj_use_gpu = spec["n_gpu_layers"] > 0
    loras = []
    for a in spec.get("adapters") or ():
        lora = x.CommonAdapterLoraInfo()
        lora.path, lora.scale = a["path"], float(a["scale"])
        loras.append(lora)
    if loras:
        p.lora_adapters = loras
    if spec.get("n_batch"):
        p.n_batch = p.n_ubatch = spec["n_batch"]  # as Ollama's num_batch: both
    mode = load_mode(spec.get("use_mmap"), spec.get("use_mlock"))
    if mode is not None:
        p.load_mode = x.llama_load_mode(mode)
    fa = spec.get("flash_attn") or "auto"
    if fa not in FLASH_ATTN:
        raise ValueError(f"unsupported flash_attn {fa!r}; use one of {', '.join(FLASH_ATTN)}")
    p.flash_attn_type = x.llama_flash_attn_type(FLASH_ATTN_TYPE[fa])
    if spec.get("chat_template"):  # a created model's TEMPLATE, in Jinja
        p.chat_template = spec["chat_template"]
    if spec.get("n_cpu_moe"):
        # llama.cpp's --n-cpu-moe: the expert tensors of the first N layers stay in system
        # memory (one buffer override per layer, as common/arg.cpp writes them).
        p.tensor_buft_overrides = ",".join(
            f"{moe_pattern(i)}=CPU" for i in range(spec["n_cpu_moe"])
        )
    return p


FLASH_ATTN_TYPE = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type


def moe_pattern(layer: int) -> str:
    """The tensors of a layer's experts (common.h's LLM_FFN_EXPS_REGEX for one block)."""
    return rf"blk\.{layer}\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def load_mode(use_mmap: bool | None, use_mlock: bool | None) -> int | None:
    """llama_load_mode's bits (MMAP = 1, MLOCK = 2) for Ollama's use_mmap / use_mlock; None
    when neither is set (llama.cpp decides)."""
    if use_mmap is None and use_mlock is None:
        return None
    return (1 if use_mmap is not False else 0) | (2 if use_mlock else 0)


def _llama_log_fn(name: str, argtypes: list[Any], restype: Any = None) -> Any:
    """A function of llama.cpp's common log (C++ symbol) in xllamacpp's library, or None."""
    import xllamacpp.xllamacpp as ext

    try:
        fn = getattr(ctypes.CDLL(ext.__file__), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def flush_llama_log() -> None:
    """Write out what llama.cpp has logged so far (its logger has a queue and a writer
    thread), so that what we print next comes after it."""
    log_main = _llama_log_fn("_Z15common_log_mainv", [], ctypes.c_void_p)
    flush = _llama_log_fn("_Z16common_log_flushP10common_log", [ctypes.c_void_p])
    if log_main is not None and flush is not None:
        flush(log_main())


def end_of_load_logging() -> None:
    """Flush the load log, mark its end, lower the verbosity for the requests to come."""
    flush_llama_log()
    set_thold = _llama_log_fn("_Z30common_log_set_verbosity_tholdi", [ctypes.c_int])
    # Without the symbol the runner keeps logging at verbosity 4: more lines, nothing lost.
    if set_thold is not None:
        set_thold(RUN_VERBOSITY)
    print(LOADED_MARKER, file=sys.stderr, flush=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    die_with_parent(spec["parent_pid"])
    try:
        kv_type = spec.get("kv_cache_type") or "f16"
        if KV_CACHE_TYPES.get(kv_type, (0,))[0] != 1:
            # A quantized KV cache the model cannot use fails here, with a message that says
            # why, rather than deep in llama.cpp's context setup. (Imported only then: the
            # GGUF reader costs ~16 MiB in every runner.)
            from corral.core.gguf import read_model_info

            check_kv_cache_type(read_model_info(spec["path"]), kv_type)
        params = build_params(spec)
    except Exception as e:  # unusable spec or unreadable model: say why, exit
        print(f"corral-runner: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    import xllamacpp as x

    try:
        server = x.Server(params)  # returns once the model is loaded and listening
    except RuntimeError as e:
        with contextlib.suppress(Exception):
            flush_llama_log()  # its errors first, then ours
        print(f"corral-runner: llama.cpp could not load the model ({e})", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    end_of_load_logging()
    print(f"READY {server.listening_address}", flush=True)
    try:
        while sys.stdin.buffer.read(4096):  # block until the parent closes our stdin
            pass
    except (OSError, KeyboardInterrupt):
        pass
    os._exit(0)  # skip slow teardown of llama.cpp's threads; the OS frees everything


if __name__ == "__main__":
    main()
