"""A stand-in for the Hugging Face hub, for tests: a small threaded HTTP server answering the
calls huggingface_hub makes to pull a model, pointed at with HF_ENDPOINT.

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: the repo's info with its
  `siblings` (with `?blobs=true`, each file's size, blob id and LFS sha256, as the hub gives
  them for `model_info(files_metadata=True)`); an unknown repo answers 401 with
  `X-Error-Code: RepoNotFound`, as the hub does.
- `HEAD` / `GET /{repo}/resolve/{rev}/{file}`: the file, with the headers huggingface_hub reads
  (`X-Repo-Commit`, `ETag` and `X-Linked-Etag` = the LFS sha256, `X-Linked-Size`,
  `Content-Length`) and Range requests (206, `Content-Range`) for resumed downloads.

Switches for tests: `break_after(file, n)` sends the next download of `file` only `n` bytes and
then drops the connection (optionally answering 503 to the next few requests, so the pull gives
up); `corrupt(file)` serves it with one byte changed (same size, wrong sha256); `throttle`
slows every download down (seconds per 64 KiB), so progress shows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 64 * 1024


@dataclass
class HubFile:
    data: bytes
    sha256: str
    lfs: bool = True

    @property
    def git_sha1(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass
class Repo:
    repo_id: str
    files: dict[str, HubFile]
    sha: str


@dataclass
class _Break:
    after: int
    then_fail: int


@dataclass
class FakeHub:
    """The stand-in hub; `start()` it (or use it as a context manager), then set
    HF_ENDPOINT to `url`. `requests` records (method, path, Range header) of every call."""

    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    throttle: float = 0.0
    _breaks: dict[str, _Break] = field(default_factory=dict)
    _failing: int = 0
    _corrupt: set[str] = field(default_factory=set)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- content ---------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, Path | bytes], lfs: bool = True) -> Repo:
        entries = {}
        for name, src in files.items():
            data = src.read_bytes() if isinstance(src, Path) else src
            entries[name] = HubFile(data, hashlib.sha256(data).hexdigest(), lfs)
        sha = hashlib.sha1(
            repo_id.encode() + b"".join(f.sha256.encode() for f in entries.values())
        ).hexdigest()
        repo = Repo(repo_id, entries, sha)
        self.repos[repo_id.lower()] = repo
        return repo

    # ---- switches --------------------------------------------------------------------------
    def break_after(self, filename: str, nbytes: int, then_fail: int = 0) -> None:
        """The next GET of `filename` sends `nbytes` bytes and drops the connection; the
        `then_fail` requests after it (any route) answer 503."""
        with self._lock:
            self._breaks[filename] = _Break(nbytes, then_fail)

    def corrupt(self, filename: str, on: bool = True) -> None:
        with self._lock:
            (self._corrupt.add if on else self._corrupt.discard)(filename)

    def reset(self) -> None:
        with self._lock:
            self._breaks.clear()
            self._corrupt.clear()
            self._failing = 0
            self.requests.clear()
            self.throttle = 0.0

    def ranges(self, filename: str) -> list[str | None]:
        """The Range headers of the GETs of `filename` so far (None: a whole-file GET)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + filename)]

    # ---- the server ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "start() the hub first"
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # ---- plumbing --------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, **headers: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message, **headers})

    def _failing(self) -> bool:
        with self.hub._lock:
            if self.hub._failing > 0:
                self.hub._failing -= 1
                return True
        return False

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        self.hub.requests.append((self.command, path, self.headers.get("Range")))
        if self._failing():
            self._error(503, "ServiceUnavailable", "the stand-in hub is down")
            return
        if path.startswith("/api/models/"):
            self._model_info(path.removeprefix("/api/models/"), parse_qs(parts.query))
            return
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            self._resolve(m.group(1), m.group(2), m.group(3))
            return
        self._error(404, "NotFound", f"no route {path}")

    # ---- routes ----------------------------------------------------------------------------
    def _repo(self, repo_id: str, rev: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id.lower())
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if rev not in ("main", repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo

    def _model_info(self, rest: str, query: dict[str, list[str]]) -> None:
        repo_id, _, rev = rest.partition("/revision/")
        repo = self._repo(repo_id, rev or "main")
        if repo is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for name, f in repo.files.items():
            s: dict[str, Any] = {"rfilename": name}
            if blobs:
                s |= {"size": len(f.data), "blobId": f.git_sha1}
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": 134}
            siblings.append(s)
        owner = repo.repo_id.split("/")[0]
        info = {
            "_id": repo.sha[:24], "id": repo.repo_id, "author": owner, "sha": repo.sha,
            "lastModified": "2026-01-01T00:00:00.000Z", "private": False, "gated": False,
            "disabled": False, "downloads": 0, "likes": 0, "tags": ["gguf"],
            "library_name": "gguf", "siblings": siblings,
        }  # fmt: skip
        self._send(200, json.dumps(info).encode())

    def _resolve(self, repo_id: str, rev: str, filename: str) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        f = repo.files.get(filename)
        if f is None:
            self._error(404, "EntryNotFound", f"{filename} does not exist", **{
                "X-Repo-Commit": repo.sha})  # fmt: skip
            return
        data = f.data
        if filename in self.hub._corrupt:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        etag = f'"{f.sha256 if f.lfs else f.git_sha1}"'
        headers = {"X-Repo-Commit": repo.sha, "ETag": etag, "Accept-Ranges": "bytes"}
        if f.lfs:
            headers |= {"X-Linked-Etag": etag, "X-Linked-Size": str(len(data))}
        start, end = 0, len(data) - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            m = re.match(r"bytes=(\d+)-(\d*)$", rng.strip())
            if not m or int(m.group(1)) >= len(data):
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else end
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        body = data[start:end + 1]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.hub._lock:
            brk = self.hub._breaks.pop(filename, None)
        limit = len(body) if brk is None else min(brk.after, len(body))
        sent = 0
        with contextlib.suppress(OSError):
            while sent < limit:
                chunk = body[sent:min(sent + CHUNK, limit)]
                self.wfile.write(chunk)
                sent += len(chunk)
                if self.hub.throttle:
                    self.wfile.flush()
                    time.sleep(self.hub.throttle)
            self.wfile.flush()
        if brk is not None:  # drop the connection mid-body
            with self.hub._lock:
                self.hub._failing += brk.then_fail
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
