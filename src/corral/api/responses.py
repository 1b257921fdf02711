"""OpenAI Responses API: POST /v1/responses, field for field as OpenAI's reference gives it.

The request becomes a neutral `events.Chat` (input items -> chat messages, function tools ->
chat tools, text.format -> llama.cpp's response_format, reasoning.effort -> the template's
enable_thinking) and the generation's events are rendered as Responses output items, streamed
as Responses SSE events or returned whole.

corral is stateless: nothing is stored, so `store` is accepted (and echoed as false) while
`previous_response_id`, `conversation` and item references are refused with a 400 that says to
send the whole conversation in `input`. Only function tools exist here; OpenAI's hosted tools
(web search, file search, ...) are refused.

Reasoning: without `reasoning.effort` the model's template decides. Effort "none" or "minimal"
turns thinking off (enable_thinking false: templates know only on and off, and "minimal" asks
for as little as possible); any other effort turns it on and passes the effort to the template
as `reasoning_effort` (low/medium/high, which templates such as gpt-oss's read).

Logprobs come with the text when `include` has "message.output_text.logprobs" or
`top_logprobs` is set. Streamed and whole answers go through the same `Builder` (not
`Generation.collect`), so their items, ids, statuses and reasoning-token counts agree.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from corral.api.common import ApiError, model_field, read_json
from corral.api.common import field as get
from corral.api.events import Chat, Done, Event, Text, Thinking, ToolCall, Usage, new_id
from corral.api.service import Service, until_disconnect
from corral.api.stream import json_response

ROLES = {"user": "user", "system": "system", "assistant": "assistant", "developer": "system"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass
class Parsed:
    """A validated request: the chat for the runner and what the response echoes back."""

    model: str
    stream: bool
    chat: Chat
    echo: dict[str, Any] = field(default_factory=dict)


class Responses:
    def __init__(self, service: Service) -> None:
        self.svc = service

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        req = parse_request(await read_json(request))
        r = self.svc.resolve(req.model)
        gen = await self.svc.generate(request, r, req.chat, options={}, keep_alive=None)
        out = Builder(req.model, req.echo)
        if req.stream:
            return gen.response(out.sse, "text/event-stream")
        try:
            await until_disconnect(request, out.consume(gen.events()))
        finally:
            gen.close()
        return json_response(out.response())


# ---- the request ---------------------------------------------------------------------------


def parse_request(body: dict[str, Any]) -> Parsed:
    """The body checked field by field (400 naming the field) and turned into a Chat."""
    model = model_field(body)
    stream = get(body, "stream", bool, False)
    if get(body, "previous_response_id", str):
        raise ApiError(
            400,
            "corral does not store responses, so 'previous_response_id' cannot be used: "
            "send the whole conversation in 'input'",
            "previous_response_id",
        )
    if body.get("conversation") is not None:
        raise ApiError(
            400,
            "corral does not store conversations: send the whole conversation in 'input'",
            "conversation",
        )
    if get(body, "background", bool):
        raise ApiError(400, "background responses are not supported by corral", "background")
    if body.get("prompt") is not None:
        raise ApiError(400, "stored prompts are not supported by corral", "prompt")

    instructions = get(body, "instructions", str)
    messages = input_messages(body.get("input"))
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    messages = merge_leading_system(messages)
    tools, echo_tools = parse_tools(get(body, "tools", list, []))
    choice, echo_choice = parse_tool_choice(body.get("tool_choice"), bool(tools))

    params: dict[str, Any] = {}
    max_out = get(body, "max_output_tokens", int)
    if max_out is not None:
        if max_out < 1:
            raise ApiError(400, "'max_output_tokens' must be at least 1", "max_output_tokens")
        params["max_tokens"] = max_out
    for name, hi in (("temperature", 2.0), ("top_p", 1.0)):
        value = get(body, name, float)
        if value is not None:
            if not 0 <= value <= hi:
                raise ApiError(400, f"'{name}' must be between 0 and {hi:g}", name)
            params[name] = value
    text = get(body, "text", dict, {})
    fmt = get(text, "format", dict, {"type": "text"}, prefix="text.")
    get(text, "verbosity", str, prefix="text.")
    params |= format_params(fmt)
    reasoning = get(body, "reasoning", dict, {})
    effort = get(reasoning, "effort", str, prefix="reasoning.")
    get(reasoning, "summary", str, prefix="reasoning.")
    if effort is not None:
        params["chat_template_kwargs"] = thinking_kwargs(effort)
    include = get(body, "include", list, [])
    top = get(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, "'top_logprobs' must be between 0 and 20", "top_logprobs")
    if top is not None or "message.output_text.logprobs" in include:
        # llama.cpp reports nothing for 0 alternatives: ask for one, show none.
        params |= {"logprobs": True, "top_logprobs": max(top or 0, 1)}
    parallel = get(body, "parallel_tool_calls", bool)
    if parallel is not None and tools:
        params["parallel_tool_calls"] = parallel

    # Accepted and echoed; corral has nothing to do with them.
    metadata = get(body, "metadata", dict, {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ApiError(400, "invalid type for 'metadata': values must be strings", "metadata")
    get(body, "store", bool)
    get(body, "stream_options", dict)
    truncation = get(body, "truncation", str, "disabled")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_out,
        "max_tool_calls": get(body, "max_tool_calls", int),
        "metadata": metadata,
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": None,
        "reasoning": {"effort": effort, "summary": reasoning.get("summary")},
        "service_tier": get(body, "service_tier", str, "default"),
        "store": False,  # whatever was asked: nothing is kept
        "temperature": params.get("temperature"),
        "text": {**text, "format": fmt},
        "tool_choice": echo_choice,
        "tools": echo_tools,
        "top_logprobs": top,
        "top_p": params.get("top_p"),
        "truncation": truncation,
        "user": get(body, "user", str),
        "safety_identifier": get(body, "safety_identifier", str),
        "prompt_cache_key": get(body, "prompt_cache_key", str),
    }
    return Parsed(model, stream, Chat(messages, tools, choice, params), echo)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as OpenAI chat messages."""
    if value is None:
        raise ApiError(400, "'input' is required: a string or an array of input items", "input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "invalid type for 'input': expected a string or an array", "input")
    if not value:
        raise ApiError(400, "'input' must not be empty", "input")
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"invalid type for '{where}': expected an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(input_message(item, where))
        elif kind == "function_call":
            call_id = _str(item, "call_id", where)
            name = _str(item, "name", where)
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _str(item, "arguments", where)},
            }
            # Calls of one turn (and the text before them) are one assistant chat message.
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _str(item, "call_id", where)
            out = item.get("output")
            content = out if isinstance(out, str) else text_of(out, f"{where}.output")
            msg = {"role": "tool", "tool_call_id": call_id, "content": content}
            if call_id in names:
                msg["name"] = names[call_id]
            messages.append(msg)
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again (templates drop it)
        elif kind == "item_reference":
            raise ApiError(
                400,
                f"'{where}': corral does not store items, so item references cannot be "
                "used: send the item itself",
                "input",
            )
        else:
            raise ApiError(
                400,
                f"'{where}': input items of type '{kind}' are not supported "
                "(corral takes message, function_call, function_call_output and reasoning)",
                "input",
            )
    return messages


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instructions and the system/developer messages before the conversation as one system
    message: many chat templates take only one, and only first."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        if not isinstance(messages[n]["content"], str):
            break
        n += 1
    if n < 2:
        return messages
    merged = "\n\n".join(m["content"] for m in messages[:n])
    return [{"role": "system", "content": merged}, *messages[n:]]


def input_message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(
            400, f"'{where}.role' must be one of user, system, developer or assistant", "input"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": ROLES[role], "content": content}
    if not isinstance(content, list):
        raise ApiError(
            400, f"invalid type for '{where}.content': expected a string or an array", "input"
        )
    parts = [content_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):  # plain text suits every chat template
        return {"role": ROLES[role], "content": "\n".join(p["text"] for p in parts)}
    return {"role": ROLES[role], "content": parts}


def content_part(part: Any, where: str) -> dict[str, Any]:
    """An input content part as an OpenAI chat content part."""
    if not isinstance(part, dict):
        raise ApiError(400, f"invalid type for '{where}': expected an object", "input")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _str(part, "text", where)}
    if kind == "refusal":
        return {"type": "text", "text": _str(part, "refusal", where)}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise ApiError(
                400,
                f"'{where}.image_url' is required (file_id is not supported by corral)",
                "input",
            )
        return {"type": "image_url", "image_url": {"url": url}}
    raise ApiError(400, f"'{where}': content of type '{kind}' is not supported", "input")


def text_of(value: Any, where: str) -> str:
    """A function call's output given as content parts: only text can go to the model."""
    if not isinstance(value, list):
        raise ApiError(400, f"invalid type for '{where}': expected a string or an array", "input")
    parts = [content_part(p, f"{where}[{j}]") for j, p in enumerate(value)]
    if any(p["type"] != "text" for p in parts):
        raise ApiError(400, f"'{where}': only text function call outputs are supported", "input")
    return "\n".join(p["text"] for p in parts)


def _str(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"'{where}.{name}' is required: a string", "input")
    return value


def parse_tools(tools: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Function tools as chat tools, and as the response echoes them."""
    chat, echo = [], []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ApiError(400, f"invalid type for '{where}': expected an object", "tools")
        if t.get("type") != "function":
            raise ApiError(
                400,
                f"'{where}': tools of type '{t.get('type')}' are not supported "
                "(corral supports only function tools)",
                "tools",
            )
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"'{where}.name' is required: a string", "tools")
        desc = get(t, "description", str, prefix=f"{where}.")
        params = get(t, "parameters", dict, prefix=f"{where}.")
        strict = get(t, "strict", bool, prefix=f"{where}.")
        fn: dict[str, Any] = {"name": name}
        if desc is not None:
            fn["description"] = desc
        fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        if strict is not None:
            fn["strict"] = strict
        chat.append({"type": "function", "function": fn})
        echo.append(
            {
                "type": "function",
                "name": name,
                "description": desc,
                "parameters": params,
                "strict": strict,
            }
        )
    return chat, echo


def parse_tool_choice(value: Any, has_tools: bool) -> tuple[str, Any]:
    """tool_choice as Chat takes it ("auto", "none", "required" or a name), and as echoed."""
    if value is None:
        return "auto", "auto"
    if value in ("auto", "none", "required"):
        choice, echo = value, value
    elif isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'tool_choice.name' is required: a string", "tool_choice")
        choice, echo = name, {"type": "function", "name": name}
    else:
        raise ApiError(
            400,
            '\'tool_choice\' must be "auto", "none", "required" or '
            '{"type": "function", "name": ...} (corral supports only function tools)',
            "tool_choice",
        )
    if choice not in ("auto", "none") and not has_tools:
        raise ApiError(
            400, "'tool_choice' asks for a tool call but no tools were given", "tool_choice"
        )
    return choice, echo


def format_params(fmt: dict[str, Any]) -> dict[str, Any]:
    """text.format as llama.cpp's response_format (grammar-constrained output)."""
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = get(fmt, "schema", dict, prefix="text.format.")
        if schema is None:
            raise ApiError(400, "'text.format.schema' is required", "text.format.schema")
        spec: dict[str, Any] = {
            "name": get(fmt, "name", str, "response", prefix="text.format."),
            "schema": schema,
        }
        strict = get(fmt, "strict", bool, prefix="text.format.")
        if strict is not None:
            spec["strict"] = strict
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    raise ApiError(
        400,
        "'text.format.type' must be one of text, json_object or json_schema",
        "text.format.type",
    )


def thinking_kwargs(effort: str) -> dict[str, Any]:
    if effort not in EFFORTS:
        raise ApiError(
            400, f"'reasoning.effort' must be one of {', '.join(EFFORTS)}", "reasoning.effort"
        )
    if effort in ("none", "minimal"):
        return {"enable_thinking": False}
    level = effort if effort in ("low", "medium", "high") else "high"
    return {"enable_thinking": True, "reasoning_effort": level}


# ---- the response --------------------------------------------------------------------------


class Builder:
    """Turns a generation's events into Responses output items, and the stream events that
    build them, one item per run of one kind (reasoning, text, each function call). The same
    code serves both streamed and whole answers, so they cannot disagree."""

    def __init__(self, model: str, echo: dict[str, Any]) -> None:
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item still being written
        self.calls: dict[int, dict[str, Any]] = {}  # ToolCall.index -> its item
        self.seq = 0
        self.thinking_deltas = 0  # one token each: the count of reasoning tokens
        self.done: Done | None = None
        self.error: str | None = None

    # -- stream events ----------------------------------------------------------------------
    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response()
        return [
            self._ev("response.created", response=snapshot),
            self._ev("response.in_progress", response=snapshot),
        ]

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        if isinstance(ev, Text):
            top = self.echo.get("top_logprobs") or 0
            return self._text(ev.text, [_logprob(lp, top) for lp in ev.logprobs])
        if isinstance(ev, Thinking):
            self.thinking_deltas += 1
            return self._thinking(ev.text)
        if isinstance(ev, ToolCall):
            return self._tool_call(ev)
        return self.finish(ev)

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [] if self._is_open("message") else self._open_message()
        item = self._current()
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        out.append(
            self._ev(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self._index(),
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return out

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self._is_open("reasoning"):
            out += self._close()
            item: dict[str, Any] = {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            out += self._add(item)
            item["content"].append({"type": "reasoning_text", "text": ""})
            out.append(
                self._ev(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(),
                    content_index=0,
                    part={"type": "reasoning_text", "text": ""},
                )
            )
        item = self._current()
        item["content"][0]["text"] += text
        out.append(
            self._ev(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=self._index(),
                content_index=0,
                delta=text,
            )
        )
        return out

    def _tool_call(self, ev: ToolCall) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        item = self.calls.get(ev.index)
        if item is None:
            out += self._close()
            item = {
                "id": new_id("fc_"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": ev.id if ev.id.startswith("call_") else new_id("call_"),
                "name": ev.name,
                "arguments": "",
            }
            self.calls[ev.index] = item
            out += self._add(item)
        else:
            item["name"] += ev.name  # a name streamed in pieces (llama.cpp sends it whole)
        if ev.arguments:
            item["arguments"] += ev.arguments
            out.append(
                self._ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=ev.arguments,
                )
            )
        return out

    def finish(self, done: Done) -> list[dict[str, Any]]:
        """Close the last item and end the stream with completed or incomplete."""
        self.done = done
        out: list[dict[str, Any]] = []
        if not self.items:  # clients read output[0]: an empty answer is an empty message
            out += self._open_message()
        out += self._close("incomplete" if done.reason == "length" else "completed")
        snapshot = self.response()
        kind = "response.incomplete" if snapshot["status"] == "incomplete" else "response.completed"
        return [*out, self._ev(kind, response=snapshot)]

    def fail(self, message: str) -> list[dict[str, Any]]:
        """A failure mid-generation: the response ends as failed, with what it had so far."""
        self.error = message
        if self.open is not None:
            self.open["status"] = "incomplete"
            self.open = None
        return [self._ev("response.failed", response=self.response())]

    # -- items --------------------------------------------------------------------------------
    def _is_open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _current(self) -> dict[str, Any]:
        assert self.open is not None
        return self.open

    def _index(self) -> int:
        return len(self.items) - 1  # the open item is always the last one

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [
            self._ev("response.output_item.added", output_index=self._index(), item=_copy(item))
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        out = self._close()
        item: dict[str, Any] = {
            "id": new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        out += self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        out.append(
            self._ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._index(),
                content_index=0,
                part=_copy(part),
            )
        )
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        self.open = None
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [
                self._ev(
                    "response.output_text.done",
                    **at,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                ),
                self._ev("response.content_part.done", **at, content_index=0, part=_copy(part)),
            ]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += [
                self._ev("response.reasoning_text.done", **at, content_index=0, text=part["text"]),
                self._ev("response.content_part.done", **at, content_index=0, part=_copy(part)),
            ]
        else:
            out.append(
                self._ev(
                    "response.function_call_arguments.done",
                    **at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = status
        out.append(
            self._ev("response.output_item.done", output_index=at["output_index"], item=_copy(item))
        )
        return out

    # -- the response object -----------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        done = self.done
        if self.error is not None:
            status = "failed"
        elif done is None:
            status = "in_progress"
        else:
            status = "incomplete" if done.reason == "length" else "completed"
        usage = None
        if done is not None:
            u = done.usage
            usage = {
                "input_tokens": u.prompt_tokens,
                # corral keeps no separate account of tokens written to the prompt cache
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": min(self.thinking_deltas, u.completion_tokens)
                },
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None
            if self.error is None
            else {"code": "server_error", "message": self.error},
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "model": self.model,
            "output": [_copy(i) for i in self.items],
            "usage": usage,
            **self.echo,
        }

    # -- driving it ----------------------------------------------------------------------------
    async def consume(self, events: AsyncIterator[Event]) -> None:
        """A whole answer: feed every event, keep only the result."""
        async for ev in events:
            self.feed(ev)
        if self.done is None:
            self.finish(Done("stop", Usage()))

    async def sse(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The streamed answer, as OpenAI's server-sent events."""
        for e in self.start():
            yield _sse(e)
        try:
            async for ev in events:
                for e in self.feed(ev):
                    yield _sse(e)
        except ApiError as err:  # the runner failed mid-stream: the headers are long gone
            for e in self.fail(err.message):
                yield _sse(e)
            return
        if self.done is None:
            for e in self.finish(Done("stop", Usage())):
                yield _sse(e)


def _sse(ev: dict[str, Any]) -> bytes:
    return b"event: " + ev["type"].encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n"


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item: the one in `items` keeps growing after an event carries it."""
    return orjson.loads(orjson.dumps(item))


def _logprob(lp: dict[str, Any], top: int) -> dict[str, Any]:
    """A llama.cpp (OpenAI chat) logprob entry as the Responses API writes one."""

    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {
            "token": e.get("token", ""),
            "bytes": e.get("bytes") or [],
            "logprob": e.get("logprob", 0.0),
        }

    return {**one(lp), "top_logprobs": [one(t) for t in (lp.get("top_logprobs") or [])[:top]]}
