"""An Anthropic Messages request as corral takes it: each field checked as Anthropic's
reference gives it (a 400 naming the field), and the request as the shared chat (api/chat):
system blocks, content blocks (text, images, tool use and results, thinking), tools, the tool
choice, thinking and the output format."""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson

from corral.api.chat import (
    Chat,
)
from corral.api.common import field
from corral.errors import ApiError

log = logging.getLogger("corral.anthropic")


def stop_sequences(body: dict[str, Any]) -> list[str]:
    stops = field(body, "stop_sequences", list, [])
    if not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop_sequences: expected an array of strings", "stop_sequences")
    return stops


def to_chat(body: dict[str, Any]) -> Chat:
    """The neutral chat request of a Messages (or count_tokens) body."""
    messages: list[dict[str, Any]] = []
    system = system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    raw = field(body, "messages", list)
    if not raw:
        raise ApiError(400, "messages: at least one message is required", "messages")
    for i, m in enumerate(raw):
        messages.extend(to_openai_messages(m, f"messages.{i}"))
    if all(m["role"] == "system" for m in messages):
        raise ApiError(400, "messages: at least one user or assistant message is required",
                       "messages")  # fmt: skip
    offered = field(body, "tools", list, [])
    tools = [to_openai_tool(t, f"tools.{i}") for i, t in enumerate(offered)]
    choice, parallel = tool_choice(body.get("tool_choice"), bool(tools))
    hosted = [t for t in tools if "function" not in t]
    tools = [t for t in tools if "function" in t]
    if hosted:
        if choice in {t["name"] for t in hosted}:
            raise ApiError(
                400, f"tool_choice: '{choice}' is a server tool, which corral cannot run",
                "tool_choice",
            )  # fmt: skip
        log.info(
            "server tools left out of the prompt (corral cannot run them): %s",
            ", ".join(t["name"] for t in hosted),
        )
    params: dict[str, Any] = {}
    for key, lo, hi in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        value = field(body, key, float)
        if value is not None:
            if not lo <= value <= hi:
                raise ApiError(400, f"{key}: must be between {lo:g} and {hi:g}", key)
            params[key] = value
    top_k = field(body, "top_k", int)
    if top_k is not None:
        if top_k < 0:
            raise ApiError(400, "top_k: must be greater than or equal to 0", "top_k")
        params["top_k"] = top_k
    if tools and parallel is not None:
        params["parallel_tool_calls"] = parallel
    params |= output_format(body.get("output_config"))
    kwargs: dict[str, Any] = {"enable_thinking": thinking(body.get("thinking"))[0]}
    effort = reasoning_effort(body.get("output_config"))
    if effort:
        kwargs["reasoning_effort"] = effort  # read by templates that take it (gpt-oss)
    params["chat_template_kwargs"] = kwargs
    field(body, "metadata", dict)  # accepted (user_id), nothing to do with it locally
    return Chat(messages, tools, choice, params)


# Claude Code's first system block, `x-anthropic-billing-header: cc_version=...; cch=...`,
# changes on every request: rendered, it would void the runner's prompt cache at the prompt's
# first tokens. Such header blocks say nothing to the model, so they are dropped.
_HEADER_BLOCK = re.compile(r"x-anthropic-[a-z-]+:[^\n]*\n?")


def system_text(system: Any, where: str = "system") -> str:
    """A system prompt (a string or text blocks) as one string, without x-anthropic-* blocks."""
    if system is None or isinstance(system, str):
        text = system or ""
        header = _HEADER_BLOCK.match(text)  # only a header line the prompt starts with
        return text[header.end() :] if header else text
    if not isinstance(system, list):
        raise ApiError(400, f"{where}: expected a string or an array of text blocks", where)
    parts = []
    for j, b in enumerate(system):
        if block_type(b, f"{where}.{j}") != "text":
            raise ApiError(400, f"{where}.{j}: only text blocks are allowed in system", where)
        text = text_of(b, f"{where}.{j}")
        if not _HEADER_BLOCK.match(text):
            parts.append(text)
    return "\n".join(parts)


def block_type(b: Any, where: str) -> str:
    if not isinstance(b, dict):
        raise ApiError(400, f"{where}: expected a content block object", where)
    kind = b.get("type")
    if not isinstance(kind, str):
        raise ApiError(400, f"{where}.type: Field required", where)
    return kind


def text_of(b: dict[str, Any], where: str) -> str:
    text = field(b, "text", str, prefix=f"{where}.")
    if text is None:
        raise ApiError(400, f"{where}.text: Field required", where)
    return str(text)


def image_part(b: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic image block as an OpenAI image_url part (llama.cpp's vision input)."""
    src = field(b, "source", dict, prefix=f"{where}.")
    kind = src.get("type") if src else None
    if src is not None and kind == "base64":
        data = field(src, "data", str, prefix=f"{where}.source.")
        media = field(src, "media_type", str, prefix=f"{where}.source.")
        if data and media:
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    elif src is not None and kind == "url":
        url = field(src, "url", str, prefix=f"{where}.source.")
        if url:
            return {"type": "image_url", "image_url": {"url": url}}
    raise ApiError(
        400, f"{where}.source: expected a base64 source (media_type, data) or a url source",
        where,
    )  # fmt: skip


def content_value(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only content as one string (what every chat template can render); content with
    images as a list of parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def to_openai_messages(m: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: a user turn's tool_result blocks become
    "tool" messages ahead of the rest of the turn; an assistant's tool_use blocks become its
    tool_calls; thinking blocks from earlier turns are dropped (templates drop them anyway)."""
    if not isinstance(m, dict):
        raise ApiError(400, f"{where}: expected an object", where)
    role = m.get("role")
    if role == "system":  # Claude Code's mid-conversation system messages; placed later
        return [{"role": "system", "content": system_text(m.get("content"), f"{where}.content")}]
    if role not in ("user", "assistant"):
        raise ApiError(400, f"{where}.role: expected 'user', 'assistant' or 'system'", where)
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: expected a string or an array of blocks", where)
    parts: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block_type(b, at)
        if kind == "text":
            parts.append({"type": "text", "text": text_of(b, at)})
        elif kind == "image" and role == "user":
            parts.append(image_part(b, at))
        elif kind == "tool_result" and role == "user":
            results.append(tool_result(b, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(tool_use(b, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise ApiError(400, f"{at}: '{kind}' blocks are not supported in {role} messages", at)
    out = results
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": content_value(parts)}
        if calls:
            msg["content"] = msg["content"] or None
            msg["tool_calls"] = calls
        out.append(msg)
    elif parts or not results:
        out.append({"role": "user", "content": content_value(parts)})
    return out


def tool_result(b: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = field(b, "tool_use_id", str, prefix=f"{where}.")
    if not call_id:
        raise ApiError(400, f"{where}.tool_use_id: Field required", where)
    field(b, "is_error", bool, prefix=f"{where}.")  # accepted; the content says what failed
    content = b.get("content")
    if content is None or isinstance(content, str):
        text: str | list[dict[str, Any]] = content or ""
    elif isinstance(content, list):
        parts = []
        for k, c in enumerate(content):
            at = f"{where}.content.{k}"
            kind = block_type(c, at)
            if kind == "text":
                parts.append({"type": "text", "text": text_of(c, at)})
            elif kind == "image":
                parts.append(image_part(c, at))
            else:
                raise ApiError(400, f"{at}: '{kind}' blocks are not supported in tool_result", at)
        text = content_value(parts)
    else:
        raise ApiError(400, f"{where}.content: expected a string or an array of blocks", where)
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def tool_use(b: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = field(b, "id", str, prefix=f"{where}.")
    name = field(b, "name", str, prefix=f"{where}.")
    if not call_id or not name:
        raise ApiError(400, f"{where}: tool_use blocks need an id and a name", where)
    args = field(b, "input", dict, {}, prefix=f"{where}.")
    return {
        "id": call_id, "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(args).decode()},
    }  # fmt: skip


def to_openai_tool(t: Any, where: str) -> dict[str, Any]:
    if not isinstance(t, dict):
        raise ApiError(400, f"{where}: expected an object", where)
    kind = t.get("type")
    name = field(t, "name", str, prefix=f"{where}.")
    if kind not in (None, "custom"):
        # A server tool (web_search_20250305, code_execution_..., ...) runs at Anthropic:
        # returned apart, so the caller can leave it out (or refuse a tool_choice naming it).
        if not isinstance(kind, str):
            raise ApiError(400, f"{where}.type: expected a string", where)
        return {"type": kind, "name": name or kind}
    schema = field(t, "input_schema", dict, prefix=f"{where}.")
    if not name:
        raise ApiError(400, f"{where}.name: Field required", where)
    if schema is None:
        raise ApiError(400, f"{where}.input_schema: Field required", where)
    fn: dict[str, Any] = {"name": name, "parameters": schema}
    desc = field(t, "description", str, prefix=f"{where}.")
    if desc:
        fn["description"] = desc
    return {"type": "function", "function": fn}


def tool_choice(tc: Any, has_tools: bool) -> tuple[str, bool | None]:
    """Anthropic's tool_choice as the neutral one, and whether parallel calls are allowed
    (None: not said)."""
    if tc is None:
        return "auto", None
    if not isinstance(tc, dict):
        raise ApiError(400, "tool_choice: expected an object", "tool_choice")
    kind = tc.get("type")
    disable = field(tc, "disable_parallel_tool_use", bool, prefix="tool_choice.")
    parallel = None if disable is None else not disable
    if kind in ("auto", "none"):
        return str(kind), parallel
    if kind not in ("any", "tool"):
        raise ApiError(
            400, "tool_choice.type: expected 'auto', 'any', 'tool' or 'none'", "tool_choice"
        )
    if not has_tools:
        raise ApiError(
            400, "tool_choice: may only be specified while providing tools", "tool_choice"
        )
    if kind == "any":
        return "required", parallel
    name = field(tc, "name", str, prefix="tool_choice.")
    if not name:
        raise ApiError(400, "tool_choice.name: Field required", "tool_choice")
    return name, parallel


def thinking(value: Any) -> tuple[bool, bool]:
    """Anthropic's `thinking` as (the template switch most reasoning templates read, whether
    to show the reasoning). A budget is checked but not enforced: max_tokens bounds thinking
    and answer together."""
    if value is None:
        return False, True
    if not isinstance(value, dict):
        raise ApiError(400, "thinking: expected an object", "thinking")
    kind = value.get("type")
    display = field(value, "display", str, prefix="thinking.")
    if display not in (None, "summarized", "omitted"):
        raise ApiError(400, "thinking.display: expected 'summarized' or 'omitted'", "thinking")
    if kind == "enabled":
        budget = field(value, "budget_tokens", int, prefix="thinking.")
        if budget is None or budget < 1:
            raise ApiError(400, "thinking.budget_tokens: expected a positive integer", "thinking")
    elif kind not in ("adaptive", "between_tools", "disabled"):
        raise ApiError(
            400, "thinking.type: expected 'enabled', 'adaptive', 'between_tools' or 'disabled'",
            "thinking",
        )  # fmt: skip
    return kind != "disabled", display != "omitted"


def reasoning_effort(config: Any) -> str | None:
    """output_config.effort as the low/medium/high that reasoning templates take."""
    if not isinstance(config, dict):
        return None
    effort = field(config, "effort", str, prefix="output_config.")
    if effort is None:
        return None
    levels = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
    if effort not in levels:
        raise ApiError(
            400, "output_config.effort: expected 'low', 'medium', 'high', 'xhigh' or 'max'",
            "output_config",
        )  # fmt: skip
    return levels[effort]


def output_format(config: Any) -> dict[str, Any]:
    """output_config.format (structured outputs) as llama.cpp's response_format."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ApiError(400, "output_config: expected an object", "output_config")
    fmt = field(config, "format", dict, prefix="output_config.")
    if fmt is None:
        return {}
    schema = field(fmt, "schema", dict, prefix="output_config.format.")
    if fmt.get("type") != "json_schema" or schema is None:
        raise ApiError(
            400, "output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
            "output_config",
        )  # fmt: skip
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
