"""Conversations keep their KV cache across eviction and keep-alive expiry.

Before the scheduler stops an idle runner (`Hooks.before_stop`: eviction, keep-alive
expiry, a reload for new options, an unload), each of its slots that holds a conversation worth
keeping is saved with llama.cpp's slot save (`POST /slots/{id}?action=save`) into the cache
directory. When a runner of the same model file and shape serves its first requests, a request
whose prompt starts with a saved conversation's tokens gets that conversation restored into a
free slot first (`?action=restore`), and is pinned to that slot (`id_slot`), so llama.cpp
evaluates only the new tokens.

A file is llama.cpp's own (runtime/slotfile reads which tokens it holds, so nothing is kept
beside it). Its name is `<key>-<digest>.slot`:
`key` hashes the model file's identity (path, size, mtime), the runner's shape (context, slots,
KV cache type, flash attention, adapters) and the engine's version, so a file is never
restored into another model or shape; `digest` hashes the tokens. llama.cpp writes under a
temporary name; the file gets its name by an atomic rename. The directory is capped
(least-recently-used files go first; a restore counts as a use); a file whose header is broken
or whose tokens do not match its name, or that llama.cpp refuses to restore, is removed with a
log line.

Reuse is verified, not assumed: llama.cpp's own count of the prompt tokens it took from the
restored cache is logged and counted. With one slot per runner (the default) it is the change
in the runner's `prompt_tokens_cached_total` (/metrics) once the restored request's prompt is
read, which costs the request nothing; with several slots, whose counters mix requests, a
one-token probe right after the restore (`/completion`, `n_predict` 0, the prompt up to the
shared prefix) makes llama.cpp report it for that slot (`timings.cache_n`).
A sliding-window or recurrent cache cannot go back past what it holds (llama.cpp #28194,
#26676): on such a model (`ModelInfo.rolls_back`) a saved conversation is restored only
for a prompt that leaves it at most ROLLBACK_SLACK tokens before its end (`closest`); a
prompt that leaves one further back is read as if nothing were saved. Where a prompt that
continues the saved tokens reuses nothing, twice in a row for a model, corral stops saving that
model's conversations. That happens on a sliding-window model with llama-server b11434
(`corral runner build cpu`): a sliding-window state it restores resumes no prompt at all (the
xllamacpp wheel's build resumes one that continues it).

Costs stay off the hot path: a request is checked only while its runner has saved
conversations not restored yet, and only among the runner's first requests. A save that would
delay a load waiting for the memory longer than re-reading the conversation would cost is
skipped (save seconds are estimated from the bytes per token and the write speed of earlier
saves, re-reading from the runner's own prompt speed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import secrets
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from corral.core.gguf import read_model_info
from corral.runtime.affinity import has_media
from corral.runtime.runner import Runner
from corral.runtime.runner_api import RunnerAPI
from corral.runtime.slotfile import CorruptEntry, common_prefix, read_tokens, token_digest

log = logging.getLogger(__name__)

SUFFIX = ".slot"
TMP_PREFIX = "tmp-"

CHAT_PATHS = frozenset({"/v1/chat/completions"})

MIN_TOKENS = 64  # a conversation shorter than this is not saved: re-reading it costs nothing
MIN_REUSE = 32  # a restore must give at least this many tokens of the prompt
CHECKS_PER_LOAD = 8  # requests after a load whose prompts are compared with saved ones
WAITING_BUDGET = 2.0  # seconds of saving a load waiting for the memory may be delayed by
DEFAULT_WRITE_BPS = 500e6  # bytes/s a save is assumed to write before one was measured
FAILURES_TO_GIVE_UP = 2  # restores in a row that reused nothing before a model is not saved
# A prompt that leaves the saved tokens within this many of their end continues them (a chat
# template renders the last answer's end a little differently than it was generated).
ROLLBACK_SLACK = 64
STALE_TMP = 600.0  # seconds after which a temporary file is a crashed save's leftover
HTTP_TIMEOUT = 30.0  # seconds for a save, a restore, a tokenization
PROBE_TIMEOUT = 600.0  # as long as a prompt: a failed restore's probe evaluates its prefix
MEASURE_INTERVAL = 0.25  # most seconds between reads of a runner's counters after a restore


@dataclass
class Entry:
    path: Path
    tokens: array[int]  # the token ids the saved state holds

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class RestoreState:
    """A runner's saved conversations not restored yet, and the measure of a restore's reuse
    (on its hop: `Hop.restore`)."""

    key: str
    pending: dict[str, Path]  # saved conversations of this key not restored yet, by name
    back: bool = True  # its cache can go back before a restored conversation's end
    checks_left: int = CHECKS_PER_LOAD
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    claimed: set[int] = field(default_factory=set)  # slots restored for a request just sent
    # Conversations this runner parked (by name): compared with every request, not only the
    # first ones, and kept when a restore only shares their start.
    parked: set[str] = field(default_factory=set)
    # A restore whose request's reuse is still to be read from the runner's counters:
    # (what was restored, the counters before the request)
    measuring: tuple[dict[str, Any], tuple[float, float]] | None = None


class RunnerHop(Protocol):
    """What the restore step needs of a runner's hop (runtime/hop.Hop, which runs this step):
    its runner, its API and its restore state."""

    runner: Runner
    restore: RestoreState | None
    restoring: bool

    @property
    def api(self) -> RunnerAPI: ...

    def changed(self) -> None:
        """A slot it held is free again: those waiting for one look again."""
        ...


_ENGINE: str | None = None


def _rolls_back(runner: Runner) -> bool:
    try:
        return read_model_info(runner.spec.path).rolls_back  # read at load already: cached
    except Exception:  # a file gone since: its key is None, nothing is restored anyway
        return True


def engine_version(runner: Runner) -> str:
    """What computes the state: a saved file is only restored by the same engine build."""
    global _ENGINE
    if runner.llama_server:
        try:
            st = os.stat(runner.llama_server)
            return f"{runner.llama_server}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            return runner.llama_server
    if _ENGINE is None:
        try:
            _ENGINE = "xllamacpp " + importlib.metadata.version("xllamacpp")
        except importlib.metadata.PackageNotFoundError:
            _ENGINE = "xllamacpp"
    return _ENGINE


def runner_key(runner: Runner) -> str | None:
    """The identity of what a runner's saved state fits: model file, runner shape, engine.
    None for a runner whose state is not saved (embeddings, a vision projector: image chunks
    in the cache are not text tokens) or whose file is gone."""
    spec = runner.spec
    if spec.embedding or spec.projector:
        return None
    try:
        st = os.stat(spec.path)
    except OSError:
        return None
    ident = [
        spec.path, st.st_size, st.st_mtime_ns, spec.n_ctx, spec.num_parallel, spec.kv_unified,
        spec.kv_cache_type, spec.flash_attn, [(a.path, a.scale) for a in spec.adapters],
        engine_version(runner),
    ]  # fmt: skip
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def closest(
    prompt: Sequence[int], entries: Iterable[Entry], held: int, back: bool = True
) -> tuple[int, Entry] | None:
    """The saved conversation to restore for `prompt`, with the tokens it shares: of those
    sharing the most (at least `held` + MIN_REUSE), the one holding the fewest tokens past
    them: less to read. Where the cache cannot go `back` (ModelInfo.rolls_back), only one the
    prompt leaves at most ROLLBACK_SLACK tokens before its end: llama.cpp resumes no other, so
    its restore would only delay the request (Gemma 3's edit at 8 clients on 2 cores: restores of
    conversations 299 and 2,047 tokens past the prompt, waiting up to 1.9 s in llama.cpp's
    queue, and then the whole prompt read again)."""
    shares = ((common_prefix(prompt, e.tokens), e) for e in entries)
    return max(
        ((n, e) for n, e in shares
         if n >= held + MIN_REUSE and (back or len(e.tokens) - n <= ROLLBACK_SLACK)),
        key=lambda ne: (ne[0], -len(ne[1].tokens)), default=None,
    )  # fmt: skip


class KVCache:
    """Saved KV caches of conversations, one file per slot, under `directory`, at most
    `max_bytes` in all; runtime/parking parks slots idle for `park_after` seconds there."""

    def __init__(self, directory: Path, max_bytes: int, park_after: float = 0.0) -> None:
        self.directory, self.max_bytes, self.park_after = directory, max_bytes, park_after
        # (name, size, mtime) -> tokens: a file changed behind corral's back is read again
        self._tokens: dict[tuple[str, int, int], array[int]] = {}
        self._failures: dict[str, int] = {}  # key -> restores in a row that reused nothing
        self.no_reuse: set[str] = set()  # keys whose restores do not work: not saved
        self._bytes_per_token: dict[str, float] = {}  # key -> bytes per saved token
        self.write_bps = DEFAULT_WRITE_BPS
        # What happened, for logs, benchmarks and tests.
        self.stats: dict[str, float] = dict.fromkeys(
            ("saves", "saved_tokens", "saved_bytes", "save_seconds", "skipped_saves",
             "restores", "restored_tokens", "reused_tokens", "failed_reuse", "dropped",
             "parks"), 0
        )  # fmt: skip
        self.last_restore: dict[str, Any] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # measures of restored requests
        directory.mkdir(parents=True, exist_ok=True)
        self._clean_tmp()

    @property
    def slot_save_path(self) -> str:
        return str(self.directory)

    # ---- saving ----------------------------------------------------------------------------
    async def before_stop(self, hop: RunnerHop, waiting: bool) -> None:
        """Save the runner's conversations before it stops (scheduler.Hooks.before_stop). With a
        load `waiting` for its memory, only saves that cost it less than they spare later,
        within WAITING_BUDGET seconds in all."""
        st = hop.restore
        if st is not None and st.measuring is not None:  # a restored request's reuse, unread
            await self._read_measure(hop, st)
        key = runner_key(hop.runner)
        if key is None or key in self.no_reuse or hop.api.closed:
            return
        slots = await hop.api.get_json("/slots")
        if not isinstance(slots, list):
            return
        with contextlib.suppress(OSError):  # removed while corral ran: llama.cpp writes there
            self.directory.mkdir(parents=True, exist_ok=True)
        full = [
            s for s in slots
            if isinstance(s, dict) and isinstance(s.get("id"), int)
            and not s.get("is_processing") and int(s.get("n_prompt_tokens") or 0) >= MIN_TOKENS
        ]  # fmt: skip
        if not full:
            return
        speed = await self.prompt_speed(hop) or None  # 0.0: no prompt read yet
        spent = 0.0
        for s in sorted(full, key=lambda s: -int(s["n_prompt_tokens"])):
            n = int(s["n_prompt_tokens"])
            save_s = n * self._estimate_bytes_per_token(hop, key) / self.write_bps
            reread_s = n / speed if speed else math.inf
            # The saved file is written now and read back on a restore: both must cost less
            # than reading the conversation again.
            if reread_s <= 2 * save_s or (waiting and spent + save_s > WAITING_BUDGET):
                self.stats["skipped_saves"] += 1
                log.info(
                    "kv cache: not saving slot %d of '%s' (%d tokens): about %.2fs to save%s, "
                    "%.2fs to read again", s["id"], hop.runner.name, n, save_s,
                    " with a load waiting" if waiting else "", reread_s,
                )  # fmt: skip
                continue
            t0 = time.monotonic()
            await self.save_slot(hop, key, s["id"])
            spent += time.monotonic() - t0
        await asyncio.to_thread(self.enforce_cap)

    async def save_slot(self, hop: RunnerHop, key: str, slot: int) -> tuple[bool, Entry | None]:
        """Save `slot` under its tokens' name: whether llama.cpp saved it, and the entry kept
        (None: it failed, or was too short to keep)."""
        tmp = f"{TMP_PREFIX}{secrets.token_hex(8)}.part"
        t0 = time.monotonic()
        res = await hop.api.slot_action(slot, "save", tmp, HTTP_TIMEOUT)
        seconds = time.monotonic() - t0
        tmp_path = self.directory / tmp
        if not isinstance(res, dict) or "n_saved" not in res:
            log.warning("kv cache: saving slot %d of '%s' failed: %s", slot, hop.runner.name, res)
            tmp_path.unlink(missing_ok=True)
            return False, None
        n, written = int(res["n_saved"]), int(res.get("n_written") or 0)
        try:
            entry = await asyncio.to_thread(self._keep, key, tmp_path, n)
        except (OSError, CorruptEntry) as e:
            log.warning("kv cache: the save of slot %d of '%s' is unusable: %s",
                        slot, hop.runner.name, e)  # fmt: skip
            tmp_path.unlink(missing_ok=True)
            return False, None
        if entry is None:
            return True, None
        if n and written:
            self._bytes_per_token[key] = written / n
        ms = float((res.get("timings") or {}).get("save_ms") or seconds * 1e3)
        if written and ms > 0:
            self.write_bps = 0.5 * self.write_bps + 0.5 * written / (ms / 1e3)
        self.stats["saves"] += 1
        self.stats["saved_tokens"] += n
        self.stats["saved_bytes"] += written
        self.stats["save_seconds"] += seconds
        log.info(
            "kv cache: saved slot %d of '%s': %d tokens, %.1f MiB in %.0f ms (%s)",
            slot, hop.runner.name, n, written / 2**20, seconds * 1e3, entry.name,
        )  # fmt: skip
        return True, entry

    def _keep(self, key: str, tmp_path: Path, n: int) -> Entry | None:
        """Name a fresh save by its tokens (atomic rename) and remove the saves of the same
        key it extends. None if it is too short to keep."""
        if n < MIN_TOKENS:
            tmp_path.unlink(missing_ok=True)
            return None
        tokens = read_tokens(tmp_path)
        if len(tokens) != n:
            raise CorruptEntry(f"holds {len(tokens)} tokens, llama.cpp said {n}")
        final = self.directory / f"{key}-{token_digest(tokens)}{SUFFIX}"
        if final.exists():  # the same conversation, restored and stopped again unchanged
            tmp_path.unlink(missing_ok=True)
            os.utime(final)
        else:
            os.replace(tmp_path, final)
        st = final.stat()
        self._tokens[(final.name, st.st_size, st.st_mtime_ns)] = tokens
        for other in self._entries(key):
            if other.path != final and common_prefix(other.tokens, tokens) == len(other.tokens):
                other.path.unlink(missing_ok=True)  # this one holds all of it and more
        return Entry(final, tokens)

    def enforce_cap(self) -> None:
        """Remove the least recently used files until the directory fits `max_bytes`."""
        files = []
        for p in self.directory.glob(f"*{SUFFIX}"):
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            log.info("kv cache: removed %s (%.1f MiB) to stay under %.1f MiB",
                     p.name, size / 2**20, self.max_bytes / 2**20)  # fmt: skip

    # ---- restoring -------------------------------------------------------------------------
    def state(self, hop: RunnerHop) -> RestoreState:
        """The hop's restore state: made on first use, with the conversations saved for its
        runner's key."""
        st = hop.restore
        if st is None:
            key = runner_key(hop.runner)
            names: dict[str, Path] = {}
            if key is not None and key not in self.no_reuse:
                with contextlib.suppress(OSError):
                    names = {p.name: p for p in self.directory.glob(f"{key}-*{SUFFIX}")}
            st = hop.restore = RestoreState(key or "", names, _rolls_back(hop.runner))
        return st

    def wants(self, hop: RunnerHop) -> bool:
        """Whether a request to its runner should be compared with saved conversations: among
        its first requests, while conversations saved for its key were not restored yet, and
        while conversations it parked are saved."""
        st = self.state(hop)
        wanted = bool(st.pending) and (st.checks_left > 0 or bool(st.parked))
        hop.restoring = wanted  # else the pipeline skips this step (until the runner parks one)
        return wanted

    async def prepare(
        self, hop: RunnerHop, path: str, payload: dict[str, Any], held: int = 0
    ) -> dict[str, Any]:
        """`payload` for the runner at `path`, pinned to a slot where the saved conversation its
        prompt continues was restored; `payload` unchanged when there is none, when the slot
        it was given holds as much (`held` tokens of it, about) or anything fails (a restore
        is an optimisation)."""
        st = hop.restore
        if st is None or not st.pending or (st.checks_left <= 0 and not st.parked):
            return payload
        first = st.checks_left > 0  # among the runner's first requests: any saved one
        st.checks_left -= 1
        started = time.monotonic()
        if payload.get("cache_prompt") is False or has_media(payload):
            return payload
        try:
            prompt = await self._prompt_tokens(hop, path, payload)
        except Exception as e:  # e.g. a template error the request itself will report
            log.debug("kv cache: could not tokenize a prompt for '%s': %s", hop.runner.name, e)
            return payload
        if len(prompt) < MIN_REUSE:
            return payload
        entries = []
        for name, p in list(st.pending.items()):
            if not first and name not in st.parked:
                continue
            entry = await asyncio.to_thread(self._load_entry, p)
            if entry is None:
                st.pending.pop(name, None)
                st.parked.discard(name)
                continue
            entries.append(entry)
        if (best := closest(prompt, entries, held, st.back)) is None:
            return payload
        shared, entry = best
        slot = await self._claim_slot(hop, st, payload.get("id_slot"))
        if slot is None:
            return payload
        parked = entry.name in st.parked
        # A parked conversation stays a candidate: this prompt may only share its start, and
        # one that continues it replaces it once parked again (a save removes those it extends).
        if not parked:
            st.pending.pop(entry.name, None)
        try:
            restored = await self._restore(
                hop, st, entry, slot, prompt, shared, started, measure=not parked
            )
        finally:
            # Held until the pinned request is queued behind the restore in llama.cpp.
            asyncio.get_running_loop().call_later(1.0, st.claimed.discard, slot)
        return {**payload, "id_slot": slot} if restored else payload

    async def _restore(
        self, hop: RunnerHop, st: RestoreState, entry: Entry, slot: int, prompt: Sequence[int],
        shared: int, started: float, measure: bool = True,
    ) -> bool:  # fmt: skip
        """Restore `entry` into `slot` and, with `measure`, see to it that what llama.cpp reuses
        of it is measured (a parked conversation's reuse is the request's own `cache_n`);
        False if the restore failed. (`started`: when the request's check began.)"""
        t0 = time.monotonic()
        res = await hop.api.slot_action(slot, "restore", entry.name, HTTP_TIMEOUT)
        restore_s = time.monotonic() - t0
        n_restored = int(res.get("n_restored") or 0) if isinstance(res, dict) else 0
        if n_restored != len(entry.tokens):
            self._drop(entry.path, f"llama.cpp did not restore it ({res})")
            return False
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # used: last to go under the cap
        self.stats["restores"] += 1
        self.stats["restored_tokens"] += n_restored
        restore = {
            "model": hop.runner.name, "slot": slot, "restored": n_restored, "shared": shared,
            "prompt": len(prompt), "restore_seconds": restore_s,
        }  # fmt: skip
        if not measure:
            restore["seconds"] = time.monotonic() - started
            self._log_restore(restore)
            self.last_restore = restore
            return True
        counters = await self._prompt_counters(hop) if hop.runner.spec.num_parallel == 1 else None
        if counters is not None:
            # One slot: the next prompt the runner reads is this request's, and its counters
            # (llama.cpp's /metrics) say what it took from the cache, with no extra decode.
            restore["seconds"] = time.monotonic() - started
            self._log_restore(restore)
            st.measuring = (restore, counters)
            self._spawn(self._measure_request(hop, st))
            return True
        # Several slots (their counters mix requests): a probe, the prompt up to one token
        # past the shared prefix, makes llama.cpp say what it takes from this slot's cache
        # while evaluating (nearly) nothing the request will not.
        probe = await hop.api.try_post("/completion", {
            "prompt": list(prompt[: shared + 1]), "n_predict": 0, "id_slot": slot,
            "cache_prompt": True, "temperature": 0,
        }, PROBE_TIMEOUT)  # fmt: skip
        restore["seconds"] = time.monotonic() - started
        self._log_restore(restore)
        timings = probe.get("timings") if isinstance(probe, dict) else None
        if isinstance(timings, dict) and "cache_n" in timings:
            self._reused(hop, st, restore, int(timings["cache_n"] or 0), "probe")
        else:
            log.warning("kv cache: how many tokens llama.cpp reuses in slot %d of '%s' is "
                        "unknown (%s)", slot, hop.runner.name, probe)  # fmt: skip
        return True

    def _log_restore(self, r: dict[str, Any]) -> None:
        log.info(
            "kv cache: '%s' restored a saved conversation into slot %d: %d tokens in %.0f ms, "
            "%d of them shared with the prompt's %d (%.0f ms before the request, tokenizing "
            "included)", r["model"], r["slot"], r["restored"], r["restore_seconds"] * 1e3,
            r["shared"], r["prompt"], r["seconds"] * 1e3,
        )  # fmt: skip

    async def _measure_request(self, hop: RunnerHop, st: RestoreState) -> None:
        """Wait for the runner to read its next prompt (the restored request's) and count
        what it took from the cache (before_stop reads it one last time)."""
        deadline = time.monotonic() + PROBE_TIMEOUT
        delay = 0.05
        while st.measuring is not None and time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 2, MEASURE_INTERVAL)
            if hop.api.closed:
                return
            await self._read_measure(hop, st)

    async def _read_measure(self, hop: RunnerHop, st: RestoreState) -> None:
        if st.measuring is None:
            return
        restore, before = st.measuring
        now = await self._prompt_counters(hop)
        if now is not None and now != before and st.measuring is not None:
            st.measuring = None
            self._reused(hop, st, restore, int(now[1] - before[1]), "request")

    def _reused(
        self, hop: RunnerHop, st: RestoreState, restore: dict[str, Any], reused: int, how: str
    ) -> None:
        """Record and report what llama.cpp really reused after a restore."""
        self.stats["reused_tokens"] += reused
        self.last_restore = {**restore, "reused": reused}
        if reused > 0:
            self._failures.pop(st.key, None)
            log.info(
                "kv cache: '%s' resumed a saved conversation in slot %d: llama.cpp reused %d "
                "of the prompt's %d tokens (measured on the %s)",
                hop.runner.name, restore["slot"], reused, restore["prompt"], how,
            )  # fmt: skip
            return
        self.stats["failed_reuse"] += 1
        back = restore["restored"] - restore["shared"]
        if back > ROLLBACK_SLACK:
            # The prompt leaves the saved tokens well before their end: a sliding-window or
            # recurrent cache cannot go back that far, restored or not. Not the model's fault.
            # (Such a restore is tried only where its GGUF shows no such layers, `closest`.)
            log.warning(
                "kv cache: '%s' restored %d tokens into slot %d but llama.cpp reused none of "
                "them: the prompt leaves them %d tokens before their end, further back than "
                "this model's cache can return (sliding-window or recurrent layers)",
                hop.runner.name, restore["restored"], restore["slot"], back,
            )  # fmt: skip
            return
        fails = self._failures[st.key] = self._failures.get(st.key, 0) + 1
        give_up = fails >= FAILURES_TO_GIVE_UP
        if give_up:
            self.no_reuse.add(st.key)
        log.warning(
            "kv cache: '%s' restored %d tokens into slot %d but llama.cpp reused none of them, "
            "though the prompt continues them (its restored cache does not resume)%s",
            hop.runner.name, restore["restored"], restore["slot"],
            "; not saving this model's conversations any more" if give_up else "",
        )  # fmt: skip

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _claim_slot(self, hop: RunnerHop, st: RestoreState, wanted: Any) -> int | None:
        if hop.runner.spec.num_parallel == 1 and wanted in (None, -1, 0):
            return 0  # the lease held for this request is the one slot's
        async with st.lock:
            slots = await hop.api.get_json("/slots")
            if not isinstance(slots, list):
                return None
            pinned = isinstance(wanted, int) and wanted >= 0
            idle = [
                s for s in slots
                if isinstance(s, dict) and isinstance(s.get("id"), int)
                and not s.get("is_processing")
                # The slot corral picked is the request's own until its lease is released.
                and (s["id"] == wanted if pinned else s["id"] not in st.claimed)
            ]  # fmt: skip
            if not idle:
                return None
            # An empty slot first: restoring over another conversation loses it.
            slot = min(idle, key=lambda s: ("id_task" in s, s["id"]))["id"]
            st.claimed.add(slot)
            return int(slot)

    async def _prompt_tokens(self, hop: RunnerHop, path: str, payload: dict[str, Any]) -> list[int]:
        """The prompt's token ids as llama.cpp will see them: a chat rendered by the runner's
        own template (`/apply-template` takes the request's body as the chat endpoint does),
        then its tokenizer with special tokens, as for generation."""
        if path in CHAT_PATHS:
            body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
            tmpl = await hop.api.try_post("/apply-template", body, HTTP_TIMEOUT)
            if not isinstance(tmpl, dict) or not isinstance(tmpl.get("prompt"), str):
                return []
            return await self._tokenize(hop, tmpl["prompt"], True)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self._tokenize(hop, prompt, True)
        if not isinstance(prompt, list):
            return []
        # llama.cpp's mixed prompt: ids as they are, strings tokenized (special tokens added
        # only to a string that comes first).
        out: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, int) and not isinstance(part, bool):
                out.append(part)
            elif isinstance(part, str):
                out += await self._tokenize(hop, part, i == 0)
            else:
                return []
        return out

    async def _tokenize(self, hop: RunnerHop, text: str, add_special: bool) -> list[int]:
        res = await hop.api.try_post("/tokenize", {
            "content": text, "add_special": add_special, "parse_special": True,
        }, HTTP_TIMEOUT)  # fmt: skip
        toks = res.get("tokens") if isinstance(res, dict) else None
        return [int(t) for t in toks] if isinstance(toks, list) else []

    # ---- files -----------------------------------------------------------------------------
    def _entries(self, key: str) -> list[Entry]:
        out = []
        for p in self.directory.glob(f"{key}-*{SUFFIX}"):
            e = self._load_entry(p)
            if e is not None:
                out.append(e)
        return out

    def _load_entry(self, path: Path) -> Entry | None:
        """The entry at `path` (its tokens read once); None, and the file removed, if it is
        corrupt or gone."""
        try:
            st = path.stat()
            ident = (path.name, st.st_size, st.st_mtime_ns)
            tokens = self._tokens.get(ident)
            if tokens is None:
                tokens = read_tokens(path)
                digest = path.name.removesuffix(SUFFIX).rpartition("-")[2]
                if token_digest(tokens) != digest:
                    raise CorruptEntry("its tokens do not match its name")
                if len(self._tokens) > 4096:
                    self._tokens.clear()
                self._tokens[ident] = tokens
        except FileNotFoundError:
            return None
        except (OSError, CorruptEntry) as e:
            self._drop(path, str(e))
            return None
        return Entry(path, tokens)

    def _drop(self, path: Path, why: str) -> None:
        log.warning("kv cache: dropping %s: %s", path.name, why)
        self.stats["dropped"] += 1
        with contextlib.suppress(OSError):
            path.unlink()

    def _clean_tmp(self) -> None:
        """Remove what crashed saves left (temporary files older than STALE_TMP)."""
        now = time.time()
        with contextlib.suppress(OSError):
            for p in self.directory.glob(f"{TMP_PREFIX}*"):
                with contextlib.suppress(OSError):
                    if now - p.stat().st_mtime > STALE_TMP:
                        p.unlink()

    # ---- the runner ---------------------------------------------------------------------
    def bytes_per_token(self, hop: RunnerHop, key: str) -> float:
        """Bytes of KV state a token of the hop's runner (of `key`) takes: measured by saves, else
        estimated from its allocation; 0.0 if unknown (runtime/slotcopy too)."""
        return self._estimate_bytes_per_token(hop, key)

    async def prompt_speed(self, hop: RunnerHop) -> float | None:
        """The runner's prompt tokens per second so far: 0.0 if it has read no prompt yet,
        None if it does not say (no /metrics) (runtime/slotcopy)."""
        found = await hop.api.metrics()
        secs = found.get("llamacpp:prompt_seconds_total")
        toks = found.get("llamacpp:prompt_tokens_total")
        if secs is None or toks is None:
            return None
        return toks / secs if secs > 0 and toks > 0 else 0.0

    def _estimate_bytes_per_token(self, hop: RunnerHop, key: str) -> float:
        known = self._bytes_per_token.get(key)
        if known is not None:
            return known
        alloc, spec = hop.runner.allocation, hop.runner.spec
        cells = spec.n_ctx * (1 if spec.kv_unified else spec.num_parallel)
        return alloc.kv_bytes / cells if alloc is not None and cells else 0.0

    async def _prompt_counters(self, hop: RunnerHop) -> tuple[float, float] | None:
        """(prompt tokens evaluated, prompt tokens taken from the cache) since the runner
        started, from llama.cpp's /metrics; None if it does not say."""
        found = await hop.api.metrics()
        evaluated = found.get("llamacpp:prompt_tokens_total")
        cached = found.get("llamacpp:prompt_tokens_cached_total")
        if evaluated is None or cached is None:
            return None
        return evaluated, cached
