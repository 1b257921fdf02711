"""Pulling models from Hugging Face with `huggingface_hub` (which honours HF_ENDPOINT and
HF_TOKEN), under the names Ollama takes: `hf.co/{owner}/{repo}[:{quant}]` (or `huggingface.co/`).

A pull has three steps, reported in Ollama's pull shape:

1. **Plan** (`plan`): the repo's file list with each file's LFS sha256 and size
   (`HfApi.model_info(files_metadata=True)`, pinned to the commit it names); the GGUF file of the
   quantization asked for (matched case-insensitively in the file name; without one, Q4_K_M like
   Ollama, else the first sensible one) and the repo's mmproj file if it has one. An unknown repo
   or quantization fails here, before any byte is downloaded (404).
2. **Download** (`download`): each file not already in the store goes to
   `.corral/partial/sha256-<hex>.partial` through huggingface_hub's `http_get`, resuming from
   the bytes a previous, interrupted pull left there (an HTTP Range request); `http_get` itself
   retries a connection that breaks mid-file from where it stopped.
3. **Verify and commit**: each download's sha256 must be the hub's LFS sha256 (a mismatch
   discards it); then it is renamed into `.corral/blobs/`, and the manifest is written
   atomically. Nothing is listed or served before this step.

(huggingface_hub's own `hf_hub_download` is not used: since 1.x it writes each download to a
process-unique temporary file that it deletes on failure, so an interrupted pull could not
resume, and it does not check the sha256.)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import corral
from corral.runtime.registry import canonical_name
from corral.runtime.store import FileRef, Manifest, Store, StoreError

log = logging.getLogger(__name__)

HUB_HOSTS = ("hf.co", "huggingface.co")
# Preferred quantizations when the name gives none: Ollama (and the hub's Ollama integration)
# take Q4_K_M when the repo has it, else a reasonable one.
PREFERRED_QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q5_K_M", "Q5_K_S", "Q5_0", "Q6_K", "Q8_0",
                    "IQ4_XS", "IQ4_NL", "Q3_K_L", "Q3_K_M", "BF16", "F16")  # fmt: skip
# huggingface_hub hands `http_get`'s file 10 MB at a time; a smaller piece keeps the progress
# moving and leaves less to fetch again when a connection breaks (a piece in flight is lost).
CHUNK_SIZE = 256 * 1024
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)


class PullError(StoreError):
    """A pull that cannot go on, with the HTTP status the API answers."""


class PullCancelled(Exception):
    """The client went away: the download stops, its partial file stays for the next pull."""


@dataclass(frozen=True)
class HubName:
    host: str  # as the user wrote it: hf.co or huggingface.co
    repo: str  # owner/name
    quant: str | None  # None: pick one

    @property
    def model_name(self) -> str:
        return canonical_name(f"{self.host}/{self.repo}:{self.quant or 'latest'}")


def parse_name(name: str) -> HubName:
    """`hf.co/{owner}/{repo}[:{quant}]` (also `huggingface.co/...`, with or without https://);
    PullError(400) for anything else, saying what corral can pull."""
    text = name.strip()
    for scheme in ("https://", "http://"):
        if text.lower().startswith(scheme):
            text = text[len(scheme) :]
    host, _, rest = text.partition("/")
    repo, _, tag = rest.partition(":")
    parts = repo.split("/")
    if host.lower() not in HUB_HOSTS or len(parts) != 2 or not all(parts):
        raise PullError(
            400, f"cannot pull '{name}': corral pulls GGUF models from Hugging Face, named "
            "hf.co/{owner}/{repo} or hf.co/{owner}/{repo}:{quantization} "
            "(e.g. hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M)",
        )  # fmt: skip
    quant = tag.strip() or None
    if quant is not None and quant.lower() == "latest":
        quant = None
    return HubName(host.lower(), repo, quant)


def is_hub_name(name: str) -> bool:
    try:
        parse_name(name)
    except PullError:
        return False
    return True


@dataclass(frozen=True)
class HubFile:
    filename: str
    size: int
    sha256: str | None  # the LFS sha256 (None for a file not in LFS: then only its size is checked)
    role: str  # "model", "part" (a split model's second part and on) or "projector"

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else ""


@dataclass(frozen=True)
class Plan:
    name: HubName
    commit: str
    files: tuple[HubFile, ...]

    @property
    def source(self) -> str:
        return f"{self.name.host}/{self.name.repo}@{self.commit}"


# ---- choosing the files ----------------------------------------------------------------------
def is_projector(filename: str) -> bool:
    return "mmproj" in Path(filename).name.lower()


def quant_matches(filename: str, quant: str) -> bool:
    """Whether `quant` is the file's quantization: a case-insensitive match of a whole
    name part ("Q4_K" is not "Q4_K_M")."""
    stem = Path(filename).name.lower().removesuffix(".gguf")
    q = re.escape(quant.lower())
    return re.search(rf"(?:^|[^a-z0-9]){q}(?![a-z0-9_])", stem) is not None


def choose(filenames: list[str], quant: str | None) -> tuple[str, str | None]:
    """The model GGUF for `quant` (or the default choice) and the repo's projector, if any.
    PullError(404) when there is no such file."""
    ggufs = sorted(f for f in filenames if f.lower().endswith(".gguf"))
    models = [f for f in ggufs if not is_projector(f)]
    # Of a split model only the first part is a candidate (the plan adds the others).
    models = [f for f in models if (m := SPLIT_RE.search(f)) is None or int(m.group(1)) == 1]
    projectors = [f for f in ggufs if is_projector(f)]
    if not models:
        raise PullError(404, "the repository has no GGUF model file")
    if quant is not None:
        found = [f for f in models if quant_matches(f, quant)]
        if not found:  # a looser match, if it names one file only
            loose = [f for f in models if quant.lower() in Path(f).name.lower()]
            if len(loose) > 1:
                raise PullError(
                    404, f"the repository has no GGUF file for quantization '{quant}'; it is "
                    f"part of several: {', '.join(quant_of(f) for f in loose)}",
                )  # fmt: skip
            found = loose
        if not found:
            have = ", ".join(sorted({quant_of(f) for f in models}))
            raise PullError(
                404, f"the repository has no GGUF file for quantization '{quant}' "
                f"(it has: {have})",
            )  # fmt: skip
        model = min(found, key=lambda f: (f.count("/"), len(f), f))
    else:
        model = next(
            (f for q in PREFERRED_QUANTS for f in models if quant_matches(f, q)), models[0]
        )
    projector = None
    if projectors:
        projector = next((f for f in projectors if quant_matches(f, "f16")), projectors[0])
    return model, projector


def quant_of(filename: str) -> str:
    """The quantization a GGUF file name shows (its last part), for error messages."""
    stem = Path(filename).name.removesuffix(".gguf").removesuffix(".GGUF")
    return re.split(r"[-.]", stem)[-1]


# ---- the hub -----------------------------------------------------------------------------------
def endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def plan(name: HubName, token: str | None = None) -> Plan:
    """The files a pull of `name` needs, from the hub's file list (blocking: run in a thread)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    api = HfApi(library_name="corral", library_version=corral.__version__)
    what = f"{name.host}/{name.repo}"
    try:
        info = api.model_info(name.repo, revision="main", files_metadata=True, token=token)
    except GatedRepoError:
        raise PullError(
            403, f"'{what}' is a gated repository: accept its terms on Hugging Face and give "
            "corral serve a token (HF_TOKEN)",
        ) from None  # fmt: skip
    except RepositoryNotFoundError:
        raise PullError(
            404, f"model '{what}' not found: Hugging Face has no repository '{name.repo}' "
            "(or it is private: give corral serve a token, HF_TOKEN)",
        ) from None  # fmt: skip
    except RevisionNotFoundError:
        raise PullError(404, f"model '{what}' not found: no revision 'main'") from None
    except HfHubHTTPError as e:
        raise PullError(502, f"Hugging Face ({endpoint()}) answered: {first_line(e)}") from None
    except (OSError, ValueError) as e:
        raise PullError(
            502, f"cannot reach Hugging Face at {endpoint()}: {first_line(e)}"
        ) from None
    except Exception as e:  # httpx errors
        if type(e).__module__.startswith("httpx"):
            raise PullError(
                502, f"cannot reach Hugging Face at {endpoint()}: {first_line(e)}"
            ) from None
        raise
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    try:
        model, projector = choose(list(siblings), name.quant)
    except PullError as e:
        raise PullError(e.status, f"cannot pull '{what}': {e.message}") from None
    wanted: list[tuple[str, str | None]] = [("model", model), ("projector", projector)]
    if (m := SPLIT_RE.search(model)) is not None:  # every part, named as the first one
        stem, count = model[: m.start()], int(m.group(2))
        for i in range(2, count + 1):
            part = f"{stem}-{i:05d}-of-{m.group(2)}.gguf"
            if part not in siblings:
                raise PullError(
                    502, f"cannot pull '{what}': part {part} of the split model is missing "
                    "from the repository",
                )  # fmt: skip
            wanted.append(("part", part))
    files = []
    for role, fname in wanted:
        if fname is None:
            continue
        s = siblings[fname]
        sha = s.lfs.sha256 if s.lfs is not None else None
        size = s.lfs.size if s.lfs is not None else s.size
        if size is None:
            raise PullError(502, f"Hugging Face gave no size for '{fname}'")
        files.append(HubFile(fname, int(size), sha.lower() if sha else None, role))
    if not info.sha:
        raise PullError(502, f"Hugging Face gave no commit for '{what}'")
    return Plan(name, info.sha, tuple(files))


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)


@dataclass
class Progress:
    total: int
    completed: int = 0


class _Sink:
    """The partial file as `http_get` writes it, counting its bytes for progress and raising
    PullCancelled once the pull is cancelled (that stops `http_get` between two chunks)."""

    def __init__(self, f: BinaryIO, cancel: threading.Event, progress: Progress) -> None:
        self.f = f
        self.cancel = cancel
        self.progress = progress
        progress.completed = f.tell()

    def write(self, data: bytes) -> int:
        if self.cancel.is_set():
            raise PullCancelled()
        n = self.f.write(data)
        self.progress.completed = self.f.tell()
        return n

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = self.f.seek(offset, whence)
        self.progress.completed = self.f.tell()
        return pos

    def truncate(self, size: int | None = None) -> int:
        return self.f.truncate(size)

    def flush(self) -> None:
        self.f.flush()


class _Quiet:
    """A progress bar that shows nothing (the server has no terminal to draw on)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass


def partial_path(store: Store, plan: Plan, f: HubFile) -> Path:
    if f.sha256:
        return store.partial_path(f.digest)
    key = hashlib.sha256(f"{plan.name.repo}@{plan.commit}/{f.filename}".encode()).hexdigest()
    return store.partial / f"file-{key}.partial"


def download(
    store: Store,
    plan: Plan,
    f: HubFile,
    progress: Progress,
    cancel: threading.Event,
    token: str | None = None,
) -> Path:
    """Download one file to its partial file, resuming what is there (blocking)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, CHUNK_SIZE)
    store.ensure()
    path = partial_path(store, plan, f)
    url = hf_hub_url(plan.name.repo, f.filename, revision=plan.commit)
    headers = build_hf_headers(
        token=token, library_name="corral", library_version=corral.__version__
    )
    with open(path, "ab"):  # create it if new, keep it if not
        pass
    with open(path, "r+b") as raw:
        resume = raw.seek(0, 2)
        if resume > f.size:  # not a prefix of this file: start again
            raw.truncate(0)
            resume = raw.seek(0)
        sink = _Sink(raw, cancel, progress)
        if resume:
            log.info("resuming %s from byte %d of %d", f.filename, resume, f.size)
        try:
            http_get(
                url, sink, resume_size=resume, headers=headers,  # type: ignore[arg-type]
                expected_size=f.size, displayed_filename=f.filename, tqdm_class=_Quiet,
            )  # fmt: skip
        except PullCancelled:
            raise
        except HfHubHTTPError as e:
            raise PullError(502, f"downloading '{f.filename}' failed: {first_line(e)}") from None
        except OSError as e:
            raise PullError(502, f"downloading '{f.filename}' failed: {first_line(e)}") from None
        except Exception as e:
            if type(e).__module__.startswith("httpx"):
                raise PullError(
                    502, f"downloading '{f.filename}' failed: {first_line(e)}"
                ) from None
            raise
        raw.flush()
    return path


def verify(store: Store, plan: Plan, f: HubFile, path: Path) -> str:
    """Check a complete download against the hub's sha256 and move it into the store; its
    digest. A mismatch discards the download (PullError 502)."""
    if f.sha256 and store.has_blob(f.digest):  # another pull of the same file got there first
        return f.digest
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
            size += len(block)
    got = h.hexdigest()
    if (f.sha256 and got != f.sha256) or size != f.size:
        path.unlink(missing_ok=True)
        want = f"sha256:{f.sha256}" if f.sha256 else f"{f.size} bytes"
        raise PullError(
            502, f"digest mismatch for '{f.filename}': want {want}, got sha256:{got} "
            f"({size} bytes); the download was discarded, pull again",
        )  # fmt: skip
    digest = f"sha256:{got}"
    if store.has_blob(digest):
        path.unlink(missing_ok=True)
    else:
        store.commit_blob(path, digest)
    return digest


# ---- the pull, as Ollama's progress lines ------------------------------------------------------
async def pull(
    store: Store, plan: Plan, token: str | None = None, interval: float = 0.2
) -> AsyncGenerator[dict[str, Any], None]:
    """Run a planned pull, yielding Ollama's progress objects; PullError on failure. Closing the
    generator early (the client left) stops the download, keeping what it got for next time."""
    yield {"status": "pulling manifest"}
    cancel = threading.Event()
    downloaded: dict[str, Path] = {}
    try:
        for f in plan.files:
            key = f.sha256 or f.filename
            line: dict[str, Any] = {"status": f"pulling {key[:12]}",
                                    "digest": f.digest or f.filename, "total": f.size}  # fmt: skip
            if f.sha256 and store.has_blob(f.digest):
                yield {**line, "completed": f.size}
                continue
            try:  # where it starts: what an interrupted pull left
                start = partial_path(store, plan, f).stat().st_size
            except OSError:
                start = 0
            last = start if start <= f.size else 0
            progress = Progress(f.size, last)
            task = asyncio.ensure_future(asyncio.to_thread(
                _locked(store, f, download), store, plan, f, progress, cancel, token
            ))  # fmt: skip
            # A download left behind (the client went away) ends with PullCancelled: expected.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            yield {**line, "completed": last}
            while True:
                done, _ = await asyncio.wait({task}, timeout=interval)
                if progress.completed != last:
                    last = progress.completed
                    yield {**line, "completed": last}
                if done:
                    break
            downloaded[f.filename] = task.result()
            if last != f.size:
                yield {**line, "completed": f.size}
        yield {"status": "verifying sha256 digest"}
        refs: dict[str, FileRef] = {}
        parts: list[FileRef] = []
        for f in plan.files:
            if f.filename in downloaded:
                digest = await asyncio.to_thread(
                    _locked(store, f, verify), store, plan, f, downloaded[f.filename]
                )
            else:
                digest = f.digest
            ref = FileRef(digest=digest, name=f.filename, size=f.size)
            if f.role == "part":
                parts.append(ref)
            else:
                refs[f.role] = ref
        yield {"status": "writing manifest"}
        manifest = Manifest(
            name=plan.name.model_name, model=refs["model"], projector=refs.get("projector"),
            source=f"{plan.source} {refs['model'].name}", parts=tuple(parts),
        )  # fmt: skip
        await asyncio.to_thread(store.write, manifest)
        yield {"status": "success"}
    finally:
        cancel.set()  # a download still running (the client left) stops at its next chunk


def _locked(store: Store, f: HubFile, fn: Any) -> Any:
    """`fn` run holding the file's blob lock, so two pulls never write one partial file."""

    def run(*args: Any) -> Any:
        if not f.sha256:
            return fn(*args)
        with store.blob_lock(f.digest):
            return fn(*args)

    return run


async def collect(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """The last object of a pull (stream: false)."""
    last: dict[str, Any] = {}
    async for item in stream:
        last = item
    return last
