"""A created model's own defaults, applied to each request for it (every API family).

`/api/create` can give a model a system prompt, messages and parameters (runtime/store.py keeps
them in its manifest, the registry puts them on its ModelEntry). As in Ollama:
- the system prompt goes first when the request has no system message of its own;
- the model's messages go before the request's (after its system message);
- each parameter is a default the request's own options override; `stop` likewise.
Runner options among the parameters (num_ctx, ...) are the entry's `options` and reach the
runner spec like models.toml's. The model's template is stored and shown, not applied: llama.cpp
renders prompts with the GGUF's own chat template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from corral.api.chat import Chat
from corral.core.options import MODEL_OPTIONS, REQUEST_OPTIONS, SAMPLING
from corral.runtime.registry import ModelEntry

LENGTH_KEYS = ("n_predict", "max_tokens", "max_completion_tokens")
SYSTEM_ROLES = ("system", "developer")


def messages(entry: ModelEntry, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model's system prompt and messages around the request's (OpenAI-style) messages."""
    if not entry.system and not entry.messages:
        return msgs
    head = [m for m in msgs[:1] if m.get("role") in SYSTEM_ROLES]
    if not head and entry.system:
        head = [{"role": "system", "content": entry.system}]
    rest = msgs[1:] if msgs[:1] and msgs[0].get("role") in SYSTEM_ROLES else msgs
    own = [{"role": str(m.get("role", "user")), "content": str(m.get("content", ""))}
           for m in entry.messages]  # fmt: skip
    return [*head, *own, *rest]


def sampling(entry: ModelEntry, params: Mapping[str, Any], length_key: str) -> dict[str, Any]:
    """`params` (llama.cpp names) with the model's parameters filled in where absent; the
    length limit (Ollama's num_predict) under `length_key` unless one is already set."""
    if not entry.parameters:
        return dict(params)
    # num_predict, the length limit, goes under `length_key` (below)
    out = {SAMPLING[k]: v for k, v in entry.parameters.items()
           if k in SAMPLING and k != "num_predict"}  # fmt: skip
    predict = entry.parameters.get("num_predict")
    if predict is not None and not any(params.get(k) is not None for k in LENGTH_KEYS):
        out[length_key] = -1 if predict == -2 else predict
    merged = dict(params)
    for k, v in out.items():
        if merged.get(k) is None:
            merged[k] = v
    return merged


def stop(entry: ModelEntry, stops: list[str] | None) -> list[str] | None:
    if stops:
        return stops
    own = entry.parameters.get("stop")
    if isinstance(own, str):
        return [own]
    return list(own) if own else stops


def chat(entry: ModelEntry, c: Chat, stops: list[str] | None) -> tuple[Chat, list[str] | None]:
    """A neutral chat request with the model's defaults (Service.generate, for a model that
    has some: `ModelEntry.has_defaults`)."""
    return (
        replace(c, messages=messages(entry, c.messages),
                params=sampling(entry, c.params, "n_predict")),
        stop(entry, stops),
    )  # fmt: skip


def openai_body(entry: ModelEntry, body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """An OpenAI chat or completions body with the model's defaults (the pass-through path, for
    a model that has some)."""
    out = sampling(entry, body, "max_tokens")
    if chat and isinstance(body.get("messages"), list):
        out["messages"] = messages(entry, body["messages"])
    if not body.get("stop") and (own := stop(entry, None)):
        out["stop"] = own
    return out


# ---- /api/show -------------------------------------------------------------------------------
def _value(v: Any) -> str:
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return str(v).lower() if isinstance(v, bool) else str(v)


def _pairs(params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, value) pairs as Ollama prints them: one per item of a list (stop), strings
    quoted."""
    return [(k, _value(item)) for k, v in params.items()
            for item in (v if isinstance(v, list | tuple) else [v])]  # fmt: skip


def parameter_text(params: Mapping[str, Any]) -> str:
    return "\n".join(f"{k:<30} {v}" for k, v in _pairs(params))


def _quoted(text: str) -> str:
    return f'"""{text}"""'


def modelfile(entry: ModelEntry, params: Mapping[str, Any]) -> str:
    """A Modelfile for the model, as `ollama show --modelfile` prints one, that `corral create`
    (or `ollama create`) takes back: its FROM names the model, which brings its files,
    projector and adapters along (a client may not read the server's paths, and its
    adapters would be added twice); the files are named in comments, as Ollama names the
    model in its, for a Modelfile built from the files themselves."""
    lines = [
        '# Modelfile generated by "corral show"',
        "# To build a new Modelfile from the model's files, replace FROM with:",
        f"# FROM {entry.path}",
    ]
    projector = getattr(entry, "projector", None)
    if projector:
        lines.append(f"# FROM {projector}")
    lines += [f"# ADAPTER {a.path}" for a in getattr(entry, "adapters", ())]
    lines += ["", f"FROM {entry.name}"]
    if entry.template is not None:
        lines.append(f"TEMPLATE {_quoted(entry.template)}")
    if entry.system is not None:
        lines.append(f"SYSTEM {_quoted(entry.system)}")
    # A model's own runner settings (models.toml's num_parallel, speculative, draft, ...) are
    # create parameters too (they also come with FROM)
    known = REQUEST_OPTIONS.keys() | MODEL_OPTIONS.keys()
    lines += [f"{'' if k in known else '# '}PARAMETER {k} {v}" for k, v in _pairs(params)]
    lines += [f"MESSAGE {m.get('role', 'user')} {_quoted(str(m.get('content', '')))}"
              for m in entry.messages]  # fmt: skip
    if entry.license is not None:
        lines.append(f"LICENSE {_quoted(entry.license)}")
    return "\n".join(lines) + "\n"
