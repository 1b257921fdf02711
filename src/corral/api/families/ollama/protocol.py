"""Ollama's requests as corral takes them: each field checked as Ollama's docs give it (a wrong
type or value is a 400 naming the field), its options as llama.cpp's sampling parameters, and
its messages, images and tool calls as the shared chat's (OpenAI-style) messages (api/chat).
The routes are in routes.py, the chunks in render.py."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson

from corral.api.common import (
    field,
)
from corral.api.service import Resolved
from corral.config import ConfigError, parse_duration
from corral.core.options import SAMPLING
from corral.errors import ApiError


def keep_alive_field(body: dict[str, Any]) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value, "'keep_alive'")
    except ConfigError as e:
        raise ApiError(400, str(e), "keep_alive") from None


def sampling(options: dict[str, Any]) -> dict[str, Any]:
    """A request's Ollama options as llama.cpp's sampling parameters."""
    out = {SAMPLING[k]: v for k, v in options.items() if k in SAMPLING}
    if out.get("n_predict") == -2:  # Ollama's "fill the context": llama.cpp's -1 does that
        out["n_predict"] = -1
    return out


def format_params(fmt: Any, chat: bool) -> dict[str, Any]:
    """Ollama's `format` ("json" or a JSON schema) as llama.cpp's constrained decoding."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}} if chat else {"json_schema": {}}
    if isinstance(fmt, dict):
        if chat:
            return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt}}}
        return {"json_schema": fmt}
    raise ApiError(400, "invalid 'format': expected \"json\" or a JSON schema object", "format")


# ---- request fields ------------------------------------------------------------------------
def think_field(body: dict[str, Any]) -> bool | str | None:
    think = field(body, "think", (bool, str))
    if isinstance(think, str) and think not in ("low", "medium", "high"):
        raise ApiError(400, "invalid 'think': expected true, false, \"low\", \"medium\" or "
                       "\"high\"", "think")  # fmt: skip
    return think


def check_think(r: Resolved, think: bool | str | None) -> None:
    if think not in (None, False) and "thinking" not in r.info.capabilities:
        raise ApiError(400, f"model '{r.requested}' does not support thinking", "think")


def logprob_fields(body: dict[str, Any]) -> int | None:
    """None without `logprobs`, else how many alternatives per token (`top_logprobs`)."""
    top = field(body, "top_logprobs", int, 0)
    if not 0 <= top <= 20:
        raise ApiError(400, "'top_logprobs' must be between 0 and 20", "top_logprobs")
    return top if field(body, "logprobs", bool, False) else None


def completion_logprobs(top: int | None) -> dict[str, Any]:
    return {} if top is None else {"n_probs": max(top, 1)}


def chat_params(
    body: dict[str, Any], options: dict[str, Any], think: bool | str | None, top: int | None
) -> dict[str, Any]:
    params = {**format_params(body.get("format"), chat=True), **sampling(options)}
    if think is not None:
        kwargs: dict[str, Any] = {"enable_thinking": think is not False}
        if isinstance(think, str):
            kwargs["reasoning_effort"] = think
        params["chat_template_kwargs"] = kwargs
    if top is not None:
        params |= {"logprobs": True, "top_logprobs": max(top, 1)}  # 0 turns them off there
    return params


def token_list(value: list[Any]) -> list[int]:
    """Ollama's `context`: token ids (non-negative integers)."""
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ApiError(400, "invalid 'context': expected an array of token ids", "context")
    return value


def check_vocabulary(context: list[int], n_vocab: int) -> None:
    """400 for a `context` id the model's vocabulary does not have (llama.cpp would refuse
    the prompt later, after the lease, or not at all)."""
    bad = next((t for t in context if t >= n_vocab), None) if n_vocab > 0 else None
    if bad is not None:
        raise ApiError(
            400, f"invalid 'context': token id {bad} is not in the model's vocabulary of "
            f"{n_vocab} tokens", "context",
        )  # fmt: skip


def image_list(value: Any, name: str) -> list[str]:
    """Ollama's `images`: base64 strings (checked, not decoded here)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ApiError(400, f"invalid type for '{name}': expected an array of base64 strings",
                       name)  # fmt: skip
    for v in value:
        try:  # a prefix of whole 4-character groups is enough to tell base64 from a path
            base64.b64decode(v[: min(len(v), 4096) // 4 * 4], validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"invalid '{name}': not base64-encoded image data", name) from None
    return value


def user_message(text: str, images: list[str]) -> dict[str, Any]:
    if not images:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    parts += [{"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b}"}}
              for b in images]  # fmt: skip
    return {"role": "user", "content": parts}


def check_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f"invalid 'tools[{i}]': expected {{\"type\": \"function\", "
                       "\"function\": {...}}", "tools")  # fmt: skip
    fn = tool["function"]
    at = f"tools[{i}].function."
    if not field(fn, "name", str, prefix=at):
        raise ApiError(400, f"'{at}name' is required", "tools")
    field(fn, "description", str, prefix=at)
    field(fn, "parameters", dict, prefix=at)
    return {"type": "function", "function": fn}


def to_openai_message(m: Any, i: int) -> dict[str, Any]:
    """An Ollama chat message as the OpenAI-style message llama.cpp's templates take."""
    if not isinstance(m, dict):
        raise ApiError(400, f"invalid type for 'messages[{i}]': expected an object", "messages")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ApiError(400, f"'messages[{i}].role' is required", "messages")
    content = m.get("content", "")
    if content is not None and not isinstance(content, str):
        raise ApiError(
            400, f"invalid type for 'messages[{i}].content': expected a string", "messages"
        )
    out = user_message(content or "", image_list(m.get("images"), f"messages[{i}].images"))
    out["role"] = role
    thinking = field(m, "thinking", str, prefix=f"messages[{i}].")
    if thinking:
        out["reasoning_content"] = thinking
    calls = field(m, "tool_calls", list, prefix=f"messages[{i}].")
    if calls:
        out["tool_calls"] = [tool_call(tc, f"messages[{i}].tool_calls[{j}]", f"call_{i}_{j}")
                             for j, tc in enumerate(calls)]  # fmt: skip
    tool_name = field(m, "tool_name", str, prefix=f"messages[{i}].")
    if role == "tool" and tool_name:
        out["name"] = tool_name
    return out


def tool_call(tc: Any, at: str, call_id: str) -> dict[str, Any]:
    """An Ollama tool call (object arguments) as an OpenAI one (arguments as JSON text)."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict):
        raise ApiError(400, f"invalid '{at}': expected {{\"function\": {{\"name\": ..., "
                       "\"arguments\": {...}}}", "messages")  # fmt: skip
    name = field(fn, "name", str, prefix=f"{at}.function.")
    if not name:
        raise ApiError(400, f"'{at}.function.name' is required", "messages")
    args = field(fn, "arguments", (dict, str), {}, prefix=f"{at}.function.")
    text = args if isinstance(args, str) else orjson.dumps(args).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}
