"""corral's own models: what `pull`, `create` and `cp` make, kept apart from the user's files.

Everything lives under `<models_dir>/.corral/`:

    blobs/sha256-<hex>          verified files: pulled GGUFs, projectors, uploaded blobs
    partial/sha256-<hex>.partial  downloads under way (the next pull resumes them)
    partial/upload-*            uploads under way (never listed, removed when they fail)
    manifests/<name>.json       one small JSON file per model name

A blob only ever appears under blobs/ by an atomic rename of a file whose sha256 has been
checked, so a half-written file is never listed or served. A manifest names the model's files,
either as blobs of the store or as paths of files corral does not own (a `*.gguf` the user put in
the models directory, the built-in model): a model created or copied from those refers to them
and deleting it never touches them. Deleting a model removes its manifest and then every blob no
other manifest still uses.

A manifest also carries what `/api/create` gives a model (template, system prompt, parameters,
messages, license), which the registry turns into the model's defaults.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

log = logging.getLogger(__name__)

STORE_DIR = ".corral"
DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


class StoreError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_digest(digest: str) -> str:
    """The hex of "sha256:<64 hex>" (Ollama's form; "sha256-" too); StoreError if malformed."""
    m = DIGEST_RE.match(digest.strip().lower()) if isinstance(digest, str) else None
    if m is None:
        raise StoreError(400, f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
    return m.group(1)


def norm_digest(digest: str) -> str:
    """ "sha256:<hex>", whatever form it came in (Ollama's blob routes take "sha256-" too)."""
    return f"sha256:{parse_digest(digest)}"


@dataclass(frozen=True)
class FileRef:
    """One file a model uses: a blob of the store (`digest`) or a file corral does not own
    (`path`, absolute). `name` is the file's own name (the hub's or the upload's), for people."""

    digest: str | None = None  # "sha256:<hex>"
    path: str | None = None
    name: str = ""
    size: int = 0

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, "", 0)}

    @staticmethod
    def from_json(d: Any) -> FileRef:
        if not isinstance(d, dict) or not (d.get("digest") or d.get("path")):
            raise ValueError(f"bad file reference {d!r}")
        name, size = str(d.get("name", "")), int(d.get("size", 0))
        return FileRef(d.get("digest"), d.get("path"), name, size)


@dataclass(frozen=True)
class Adapter:
    file: FileRef
    scale: float = 1.0


@dataclass(frozen=True)
class Manifest:
    name: str  # canonical model name
    model: FileRef
    projector: FileRef | None = None
    adapters: tuple[Adapter, ...] = ()
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # Ollama's names and types
    messages: tuple[dict[str, Any], ...] = ()
    license: str | None = None
    source: str = ""  # where it came from: "hf.co/owner/repo@<commit> <file>", "from <model>"
    created_at: float = 0.0
    # A split model's other parts (`model` is the first), in order, named as on the hub
    parts: tuple[FileRef, ...] = ()

    def refs(self) -> list[FileRef]:
        return [self.model, *self.parts, *([self.projector] if self.projector else []),
                *(a.file for a in self.adapters)]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": 1, "name": self.name, "model": self.model.to_json()}
        if self.projector:
            out["projector"] = self.projector.to_json()
        if self.adapters:
            out["adapters"] = [{**a.file.to_json(), "scale": a.scale} for a in self.adapters]
        if self.parts:
            out["parts"] = [p.to_json() for p in self.parts]
        for key in ("template", "system", "license"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.parameters:
            out["parameters"] = self.parameters
        if self.messages:
            out["messages"] = list(self.messages)
        out["source"] = self.source
        out["created_at"] = self.created_at
        return out

    @staticmethod
    def from_json(d: Any) -> Manifest:
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            raise ValueError("not a corral manifest")
        adapters = tuple(
            Adapter(FileRef.from_json(a), float(a.get("scale", 1.0))) for a in d.get("adapters", [])
        )
        params = d.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError("parameters: expected an object")
        return Manifest(
            name=d["name"],
            model=FileRef.from_json(d.get("model")),
            projector=FileRef.from_json(d["projector"]) if d.get("projector") else None,
            adapters=adapters,
            template=_opt_str(d, "template"),
            system=_opt_str(d, "system"),
            parameters=params,
            messages=tuple(m for m in d.get("messages", []) if isinstance(m, dict)),
            license=_opt_str(d, "license"),
            source=str(d.get("source", "")),
            created_at=float(d.get("created_at", 0.0)),
            parts=tuple(FileRef.from_json(p) for p in d.get("parts") or ()),
        )


def _opt_str(d: dict[str, Any], key: str) -> str | None:
    v = d.get(key)
    return v if isinstance(v, str) else None


class Store:
    """The `.corral` directory of one models directory. Safe to share between threads: writes
    are atomic renames, and one lock per blob keeps two pulls from downloading it twice."""

    def __init__(self, models_dir: Path) -> None:
        self.root = models_dir / STORE_DIR
        self.blobs = self.root / "blobs"
        self.partial = self.root / "partial"
        self.manifests = self.root / "manifests"
        self.splits = self.root / "splits"  # split models' parts linked under their names
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def ensure(self) -> None:
        for d in (self.blobs, self.partial, self.manifests):
            d.mkdir(parents=True, exist_ok=True)

    def model_path(self, m: Manifest) -> Path:
        """The path a runner loads the model from. A split model's parts are blobs named by
        digest, but llama.cpp finds the parts after the first by name: they are linked under
        their hub names in splits/<first part's digest>/ (made again if missing)."""
        first = self.path_of(m.model)
        if not m.parts or m.model.digest is None:
            return first
        view = self.splits / parse_digest(m.model.digest)
        with contextlib.suppress(OSError):
            view.mkdir(parents=True, exist_ok=True)
            for ref in (m.model, *m.parts):
                link = view / Path(ref.name).name
                target = self.path_of(ref)
                if not link.is_symlink() or os.readlink(link) != str(target):
                    tmp = view / f".{link.name}.tmp"
                    tmp.unlink(missing_ok=True)
                    tmp.symlink_to(target)
                    os.replace(tmp, link)
        return view / Path(m.model.name).name

    # ---- blobs -----------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return self.blobs / f"sha256-{parse_digest(digest)}"

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def partial_path(self, digest: str) -> Path:
        return self.partial / f"sha256-{parse_digest(digest)}.partial"

    def path_of(self, ref: FileRef) -> Path:
        if ref.digest is not None:
            return self.blob_path(ref.digest)
        assert ref.path is not None
        return Path(ref.path)

    @contextlib.contextmanager
    def blob_lock(self, digest: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(parse_digest(digest), threading.Lock())
        with lock:
            yield

    def commit_blob(self, tmp: Path, digest: str) -> Path:
        """Move a file whose sha256 was checked into blobs/ (atomic: same filesystem)."""
        dest = self.blob_path(digest)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        return dest

    def upload_file(self) -> tuple[int, Path]:
        """A fresh temporary file for an upload under partial/ (fd, path)."""
        self.ensure()
        fd, name = tempfile.mkstemp(prefix="upload-", dir=self.partial)
        return fd, Path(name)

    # ---- manifests -------------------------------------------------------------------------
    def manifest_path(self, name: str) -> Path:
        return self.manifests / (quote(name, safe="") + ".json")

    def read(self, name: str) -> Manifest | None:
        try:
            return Manifest.from_json(json.loads(self.manifest_path(name).read_text()))
        except FileNotFoundError:
            return None

    def all(self) -> list[Manifest]:
        """Every readable manifest; broken ones are logged and skipped."""
        out = []
        try:
            paths = sorted(self.manifests.glob("*.json"))
        except OSError:
            return []
        for p in paths:
            try:
                m = Manifest.from_json(json.loads(p.read_text()))
            except (OSError, ValueError, TypeError) as e:
                log.error("ignoring broken manifest %s: %s", p, e)
                continue
            if m.name != unquote(p.name.removesuffix(".json")):
                log.error("ignoring manifest %s: it names %r", p, m.name)
                continue
            out.append(m)
        return out

    def write(self, manifest: Manifest) -> list[str]:
        """Write (or replace) a manifest atomically. The blobs only the replaced manifest used
        are removed; returns their paths."""
        self.ensure()
        if not manifest.created_at:
            manifest = replace(manifest, created_at=time.time())
        old = self.read(manifest.name)
        data = json.dumps(manifest.to_json(), indent=1, ensure_ascii=False).encode()
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json.tmp", dir=self.manifests)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.manifest_path(manifest.name))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return self._collect(old.refs() if old else [])

    def delete(self, name: str) -> list[str]:
        """Remove a model's manifest and the blobs no other model uses; returns the paths
        removed. Files the manifest refers to by path are never touched."""
        old = self.read(name)
        path = self.manifest_path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise StoreError(404, f"model '{name}' not found") from None
        return [str(path), *self._collect(old.refs() if old else [])]

    def prune(self, grace: float = 3600.0, stale_partial: float = 7 * 86400.0) -> list[str]:
        """At start-up, as Ollama prunes: remove blobs no manifest uses (uploads never created
        into a model, leftovers of a crash) once older than `grace`, abandoned upload files,
        and downloads not resumed for `stale_partial` seconds; returns the paths removed."""
        now = time.time()
        used = {parse_digest(r.digest) for m in self.all() for r in m.refs() if r.digest}
        removed = []

        def old(p: Path, age: float) -> bool:
            try:
                return now - p.stat().st_mtime > age
            except OSError:
                return False

        candidates = []
        with contextlib.suppress(OSError):
            for p in self.blobs.iterdir():
                if p.name.removeprefix("sha256-") not in used and old(p, grace):
                    candidates.append(p)
        with contextlib.suppress(OSError):
            for view in self.splits.iterdir():  # links of a split model no longer there
                if not (self.blobs / f"sha256-{view.name}").exists():
                    shutil.rmtree(view, ignore_errors=True)
        with contextlib.suppress(OSError):
            for p in self.partial.iterdir():
                if old(p, grace if p.name.startswith("upload-") else stale_partial):
                    candidates.append(p)
        for p in candidates:
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(str(p))
        return removed

    def _collect(self, candidates: list[FileRef]) -> list[str]:
        """Remove those of `candidates`' blobs that no manifest refers to any more. (Uploaded
        blobs no model uses yet are kept: a `create` is probably about to use them.)"""
        used = {r.digest for m in self.all() for r in m.refs() if r.digest}
        removed = []
        for ref in candidates:
            if ref.digest is None or ref.digest in used:
                continue
            path = self.blob_path(ref.digest)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(str(path))
            view = self.splits / parse_digest(ref.digest)  # it was a split model's first part
            if view.is_dir():
                shutil.rmtree(view, ignore_errors=True)
        return removed
