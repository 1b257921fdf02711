"""A new conversation starts from what another slot holds: a copy of that slot's KV state.

runtime/affinity gives a new conversation an empty slot rather than another conversation's, and
names the idle slot that holds most of its prompt (`Pick.source`: one that shares a system
prompt and tools, or only the chat template's preamble). Evaluating that shared prefix again
costs a prompt's time (a 12k-token agent prompt: 18 s on a CPU); copying it costs its state's
bytes written and read back. So, where that pays (`affinity.copy_pays`, from the bytes per token
of state, the copies' measured speed and the runner's own prompt speed), the source slot is
saved (`POST /slots/{source}?action=save`, under a temporary name in the KV cache directory,
llama.cpp's slot_save_path) and restored into the chosen slot (`?action=restore`); the request,
pinned to that slot, then reuses the common prefix (cache_prompt) and llama.cpp drops the rest.

llama.cpp defers a save of a slot that is processing until it is idle, and a restore into one
likewise: the source is one whose lease is released (its last request answered), and the
target is held by the request's own lease. A copy is bounded (one that would take longer than
the evaluation it spares is given up: llama.cpp cancels the deferred task when the connection
closes), and anything that fails (a runner without a slot_save_path, a full disk, a
restore llama.cpp refuses, which clears the slot) leaves the request to evaluate its prompt as
it would have. The file is removed after the restore.

Not copied: requests with images or audio (their chunks are not text), prompts llama.cpp reads
as several (a list of strings), `cache_prompt: false`, several choices (`n`), runners of a
vision projector, and models with sliding-window or recurrent layers, whose restored cache
cannot go back to a prefix shorter than what it holds (llama.cpp #28194, #26676).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol

from corral.core.gguf import read_model_info
from corral.runtime.affinity import BYTES_PER_TOKEN, CopyPays, Pick, copy_pays, has_media
from corral.runtime.kvcache import TMP_PREFIX, KVCache, RunnerHop, runner_key

log = logging.getLogger(__name__)

COPY_PREFIX = f"{TMP_PREFIX}copy-"
# Bytes a copy writes and reads back per second, before one was measured: low, so that copies
# are not made where their worth is in doubt (a page-cache write and read run at GB/s).
DEFAULT_COPY_BPS = 250e6
MIN_WAIT_S = 0.25  # seconds a copy (its save and its restore) may take, at least
MAX_WAIT_S = 10.0  # and at most, whatever it spares
SPEED_TTL_S = 10.0  # seconds a runner's prompt speed, read from its /metrics, is taken as known
ORPHAN_S = 60.0  # seconds after which a copy's file is a leftover (a save cancelled late)


@dataclass
class CopyState:
    """A runner's figures for copies (on its hop: `Hop.copies`)."""

    usable: bool  # whether a restored state serves a shorter prefix (no sliding window, ...)
    key: str
    bytes_per_token: float = 0.0  # of KV state: measured by copies, estimated before
    speed: float | None = None  # prompt tokens/s (/metrics)
    speed_at: float = -SPEED_TTL_S
    reading: asyncio.Future[None] | None = None  # a read of it under way
    says: bool = True  # whether its /metrics tells the speed (a stand-in runner may not)


class CopyHop(RunnerHop, Protocol):
    """What the copy step needs of a runner's hop (runtime/hop.Hop): the restore step's, and
    its copy figures."""

    copies: CopyState | None


class SlotCopier:
    """Copies of one slot's KV state into another of the same runner, through `kvcache`'s
    directory (llama.cpp's slot_save_path)."""

    def __init__(self, kvcache: KVCache) -> None:
        self.kvcache = kvcache
        self.copy_bps = DEFAULT_COPY_BPS
        self._swept = 0.0
        # What happened, for logs and tests.
        self.stats: dict[str, float] = dict.fromkeys(
            ("copies", "copied_tokens", "copied_bytes", "copy_seconds", "skipped", "failed"), 0
        )
        self.last_copy: dict[str, Any] | None = None

    def wants(self, hop: CopyHop, path: str, payload: dict[str, Any]) -> bool:
        """Whether a request's prompt can start from another slot's state (see the module)."""
        runner = hop.runner
        if not runner.slot_save_path or runner.spec.projector or runner.spec.embedding:
            return False
        if payload.get("cache_prompt") is False or has_media(payload):
            return False
        if payload.get("n", 1) != 1 or payload.get("n_cmpl", 1) != 1:
            return False  # several choices: llama.cpp runs the others on other slots
        if path != "/v1/chat/completions":
            prompt = payload.get("prompt")
            # One prompt: a text, or token ids with at most one text (Ollama's context);
            # several texts are several prompts, each a task of its own.
            if not isinstance(prompt, str) and not (
                isinstance(prompt, list) and sum(isinstance(p, str) for p in prompt) <= 1
                and all(isinstance(p, str | int) for p in prompt)
            ):  # fmt: skip
                return False
        return self._info(hop).usable

    def _info(self, hop: CopyHop) -> CopyState:
        info = hop.copies
        if info is None:
            try:
                model = read_model_info(hop.runner.spec.path)  # read at load already: cached
            except Exception:  # a file gone since: no copies
                model = None
            key = runner_key(hop.runner) or ""
            usable = model is not None and model.rolls_back
            info = hop.copies = CopyState(usable, key)
            # llama.cpp's KV buffer over its cells; else K and V of every layer in f16 (more
            # than a quantized cache: copies thought dearer than they are, not cheaper).
            info.bytes_per_token = self.kvcache.bytes_per_token(hop, key) or (
                2.0 * sum(model.n_head_kv) * (model.head_dim_k + model.head_dim_v) if model else 0.0
            )
        return info

    async def refresh(self, hop: CopyHop) -> None:
        """Read the runner's prompt speed again (its /metrics) if it is unknown or what is
        known is older than SPEED_TTL_S: `pays` goes by it. Unknown (until the runner has read
        a prompt), the request waits for the answer; known, or where the runner does not say
        (no /metrics: asked again only as often as a known one), it is read again in the
        background: /metrics is a task in the runner's queue, which waits for a decoding step,
        and the request goes by what is known meanwhile."""
        info = self._info(hop)
        unknown = not info.speed and info.says
        if info.reading is None and (unknown or time.monotonic() - info.speed_at > SPEED_TTL_S):
            info.speed_at = time.monotonic()
            info.reading = asyncio.ensure_future(self._read_speed(hop, info))
        if unknown and info.reading is not None:
            await asyncio.shield(info.reading)

    async def _read_speed(self, hop: CopyHop, info: CopyState) -> None:
        try:
            speed = await self.kvcache.prompt_speed(hop)
            info.says = speed is not None
            info.speed = speed or info.speed
        except Exception as e:  # a runner going away: its figures go with it
            log.debug("slot copy: reading the prompt speed of '%s' failed: %s",
                      hop.runner.name, e)  # fmt: skip
        finally:
            info.reading = None

    def pays(self, hop: CopyHop) -> CopyPays:
        """Whether a copy pays on the hop's runner (affinity.copy_pays with its figures), for
        `Slots.pick`."""
        info = self._info(hop)

        def pays(spared: int, source_size: int) -> bool:
            ok = copy_pays(spared, source_size, info.bytes_per_token, self.copy_bps, info.speed)
            if not ok:
                self.stats["skipped"] += 1
                log.debug(
                    "slot copy: not worth it on '%s': about %d tokens of state (%.0f bytes "
                    "each) to spare about %d at %s tokens/s", hop.runner.name,
                    source_size // BYTES_PER_TOKEN, info.bytes_per_token,
                    spared // BYTES_PER_TOKEN, f"{info.speed:.0f}" if info.speed else "unknown",
                )  # fmt: skip
            return ok

        return pays

    async def copy(self, hop: CopyHop, pick: Pick) -> bool:
        """Copy `pick.source`'s state into `pick.slot` (a pick made with `pays`); whether it
        was copied."""
        assert pick.source is not None
        info = self._info(hop)
        # The save and the restore together wait as long as evaluating what the copy spares
        # would take, within bounds: a copy given up costs the request at most that again.
        spared_s = pick.spared / BYTES_PER_TOKEN / info.speed if info.speed else 0.0
        deadline = time.monotonic() + min(MAX_WAIT_S, max(MIN_WAIT_S, spared_s))
        self._sweep(time.monotonic())
        name = f"{COPY_PREFIX}{secrets.token_hex(8)}.part"
        try:
            return await self._copy(hop, info, pick, name, deadline)
        finally:
            with contextlib.suppress(OSError):
                (self.kvcache.directory / name).unlink(missing_ok=True)

    async def _copy(
        self, hop: CopyHop, info: CopyState, pick: Pick, name: str, deadline: float
    ) -> bool:
        assert pick.source is not None
        t0 = time.monotonic()
        saved = await hop.api.slot_action(pick.source, "save", name, deadline - t0)
        t1 = time.monotonic()
        if not isinstance(saved, dict) or not saved.get("n_saved"):
            return self._failed(hop, pick, f"the save failed: {saved}")
        if deadline - t1 <= 0:
            return self._failed(hop, pick, "no time left to restore it")
        restored = await hop.api.slot_action(pick.slot, "restore", name, deadline - t1)
        t2 = time.monotonic()
        n = int(saved["n_saved"])
        if not isinstance(restored, dict) or int(restored.get("n_restored") or 0) != n:
            return self._failed(hop, pick, f"the restore failed: {restored}")
        written = int(saved.get("n_written") or 0)
        if written:
            info.bytes_per_token = written / n
            # Its speed from llama.cpp's own timings (the file's write and read), not the
            # round trips; the overhead is counted apart (affinity.COPY_OVERHEAD_S).
            ms = float((saved.get("timings") or {}).get("save_ms") or 0) + float(
                (restored.get("timings") or {}).get("restore_ms") or 0
            )
            if ms > 0:
                self.copy_bps = 0.5 * self.copy_bps + 0.5 * 2 * written / (ms / 1e3)
        self.stats["copies"] += 1
        self.stats["copied_tokens"] += n
        self.stats["copied_bytes"] += written
        self.stats["copy_seconds"] += t2 - t0
        self.last_copy = {"model": hop.runner.name, "source": pick.source, "slot": pick.slot,
                          "tokens": n, "bytes": written, "seconds": t2 - t0}  # fmt: skip
        log.debug(
            "slot copy: '%s' copied slot %d into slot %d for a new conversation: %d tokens, "
            "%.1f MiB in %.0f ms (save %.0f, restore %.0f) to spare about %d tokens",
            hop.runner.name, pick.source, pick.slot, n, written / 2**20, (t2 - t0) * 1e3,
            (t1 - t0) * 1e3, (t2 - t1) * 1e3, pick.spared // BYTES_PER_TOKEN,
        )  # fmt: skip
        return True

    def _failed(self, hop: CopyHop, pick: Pick, why: str) -> bool:
        self.stats["failed"] += 1
        log.debug("slot copy: copying slot %d of '%s' into slot %d failed (the prompt is "
                  "evaluated): %s", pick.source, hop.runner.name, pick.slot, why)  # fmt: skip
        return False

    def _sweep(self, now: float) -> None:
        """Remove copies' files left behind (a save llama.cpp ran after its request gave up),
        at most once a minute."""
        if now - self._swept < ORPHAN_S:
            return
        self._swept = now
        cutoff = time.time() - ORPHAN_S
        with contextlib.suppress(OSError):
            for p in self.kvcache.directory.glob(f"{COPY_PREFIX}*"):
                with contextlib.suppress(OSError):
                    if p.stat().st_mtime < cutoff:
                        p.unlink()
