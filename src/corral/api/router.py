"""llama.cpp's router-mode API, so its clients and web UI can drive corral: `GET /models` (every
model with its status), `POST /models/load`, `POST /models/unload`, the router's event stream
`GET /models/sse`, and corral's additions there, `POST /models` (download from Hugging Face)
and `DELETE /models`. (llama.cpp's server API, routed by `model`, is
api/families/llamacpp.)

Errors take corral's plain shape (`family.OLLAMA`), as they always have on these paths.

`/models/sse`: `data: {"model", "event", "data"}` lines, `model_status` when a load starts,
`status_change` with `{"status": "loading", "progress": {"stages", "current", "value"}}` while
it loads, then `loaded` or `unloaded` (with `exit_code`). The progress is `Runner.progress`
(see runtime/loadwatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.common import json_response, model_field, read_json, until_disconnect
from corral.api.family import OLLAMA, SSE, FamilyRoute
from corral.api.manage import Manage, model_name, store_error
from corral.api.paths import shown_path
from corral.api.service import Service
from corral.api.stream import SSE_HEADERS, RelayResponse, journal_events, stopping
from corral.errors import ApiError
from corral.runtime import hub
from corral.runtime.registry import runner_model
from corral.runtime.store import StoreError

PROGRESS_INTERVAL = 0.2  # seconds between looks at loading runners on /models/sse
PING_INTERVAL = 15.0  # an SSE comment this often, so a dead connection is noticed
UNLOADED: tuple[str, float | None] = ("unloaded", None)


class Router:
    def __init__(self, service: Service, manage: Manage) -> None:
        self.svc = service
        self.scheduler = service.scheduler
        self.manage = manage

    def routes(self) -> list[Route]:
        return [
            FamilyRoute(OLLAMA, "/models", self.models, ["GET"]),
            FamilyRoute(OLLAMA, "/models", self.download, ["POST"]),
            FamilyRoute(OLLAMA, "/models", self.delete, ["DELETE"]),
            FamilyRoute(OLLAMA, "/models/load", self.load, ["POST"]),
            FamilyRoute(OLLAMA, "/models/unload", self.unload, ["POST"]),
            FamilyRoute(OLLAMA, "/models/sse", self.events, ["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        states = {r.model: r.state for r in self.svc.scheduler.view().runners}
        reg = self.svc.registry
        data = [
            {"id": e.name, "object": "model", "owned_by": "corral", "created": int(e.modified_at),
             "path": shown_path(request, e.path, reg.models_dir),
             # a model whose runner another name of its file loaded is loaded too
             "status": {"value": _router_state(states.get(reg.runner_name(e.name)))}}
            for e in self.svc.registry.all()
        ]  # fmt: skip
        return json_response({"object": "list", "data": data})

    async def load(self, request: Request) -> Response:
        body = await read_json(request)
        r = self.svc.resolve(model_field(body))
        start = time.monotonic()
        async with await self.svc.lease(request, r, {}, None):
            pass  # loaded: that is all a load asks for
        return json_response({"success": True, "load_ms": int((time.monotonic() - start) * 1e3)})

    async def unload(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_field(body)
        if not self.svc.unload(name):
            raise ApiError(400, f"model '{name}' is not loaded", "model")
        return json_response({"success": True})

    # ---- corral's additions: download, delete -------------------------------------------------
    async def download(self, request: Request) -> Response:
        """POST /models {"model": "hf.co/owner/repo:quant"} (or "owner/repo:quant", as
        llama-server -hf takes it): pull, then answer once it is done."""
        body = await read_json(request)
        name = model_name(body)
        if name.count("/") == 1 and not name.lower().startswith(hub.HUB_HOSTS):
            name = f"hf.co/{name}"
        plan = await self.manage.plan(request, name)
        progress = hub.pull(self.manage.store, plan)
        try:
            await until_disconnect(request, hub.collect(progress))
        except StoreError as e:
            raise store_error(e) from None
        finally:
            await progress.aclose()
        return json_response({"success": True, "model": plan.name.model_name})

    async def delete(self, request: Request) -> Response:
        body = await read_json(request)
        out = await self.manage.remove(model_name(body))
        return json_response({"success": True, "removed": out["removed"]})

    # ---- the event stream ---------------------------------------------------------------------
    def _states(self) -> dict[str, tuple[str, float | None]]:
        """model -> (llama.cpp router status, load progress) for every model with a runner.
        A runner on its way out is still "loaded" until its process is gone (as in llama.cpp's
        router), so that the "unloaded" event can tell a crash (exit_code 1) from a stop."""
        out: dict[str, tuple[str, float | None]] = {}
        for r in self.scheduler.view().runners:
            if runner_model(r.model) != r.model:  # a model's embedding runner: no model's status
                continue
            if r.state == "unloading":
                out.setdefault(r.model, ("loaded", None))
            elif r.state == "loading":
                out[r.model] = ("loading", r.progress)
            else:
                out[r.model] = ("loaded", None)
        return out

    async def events(self, request: Request) -> Response:
        """llama.cpp router's `GET /models/sse`: status changes and load progress."""

        def line(model: str, event: str, data: dict[str, Any]) -> bytes:
            msg = {"model": model, "event": event, "data": data}
            return b"data: " + orjson.dumps(msg) + b"\n\n"

        async def stream() -> AsyncIterator[bytes]:
            async with journal_events(self.scheduler) as q:
                seen = self._states()
                failed: set[str] = set()
                pinged = time.monotonic()
                while not stopping(request, self.scheduler):
                    started: set[str] = set()  # loads begun since the last look
                    with contextlib.suppress(asyncio.TimeoutError):
                        evs = [await asyncio.wait_for(q.get(), PROGRESS_INTERVAL)]
                        while not q.empty():
                            evs.append(q.get_nowait())
                        for ev in evs:
                            if ev.kind in ("load_failed", "crash"):
                                failed.add(ev.model)
                            elif ev.kind == "load":
                                started.add(ev.model)
                    now = self._states()
                    for model in sorted(set(seen) | set(now) | started):
                        old, new = seen.get(model, UNLOADED), now.get(model, UNLOADED)
                        if old == new and model not in started:
                            continue
                        status, progress = new
                        if old[0] != "loading" and (status == "loading" or model in started):
                            yield line(model, "model_status", {"status": "loading"})
                        if status == "loading" and progress is not None:
                            yield line(model, "status_change", {"status": "loading", "progress": {
                                "stages": ["text_model"], "current": "text_model",
                                "value": round(progress, 4),
                            }})  # fmt: skip
                        elif status == "loaded" and old[0] != "loaded":
                            yield line(model, "status_change", {"status": "loaded"})
                        elif status == "unloaded" and (old[0] != "unloaded" or model in failed):
                            code = 1 if model in failed else 0
                            failed.discard(model)
                            yield line(model, "status_change",
                                       {"status": "unloaded", "exit_code": code})  # fmt: skip
                    seen = now
                    if time.monotonic() - pinged >= PING_INTERVAL:
                        pinged = time.monotonic()
                        yield b": ping\n\n"

        return RelayResponse(stream(), SSE, headers=SSE_HEADERS)


def _router_state(state: str | None) -> str:
    return {"loading": "loading", "ready": "loaded"}.get(state or "", "unloaded")
