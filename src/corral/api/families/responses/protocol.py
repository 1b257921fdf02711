"""A Responses request as corral takes it: each field checked as OpenAI's reference gives it
(a 400 naming the field), the input items as the shared chat's messages (after a stored
conversation's, for `previous_response_id`), and its tools, tool choice and text format.

Tools, as agents such as the Codex CLI send them (in `tools` and in `additional_tools` input
items):
- `function` tools go to the model as they are.
- `namespace` tools (a named group of function and custom tools) are flattened: the model sees
  each member under its own name, or `<namespace>__<name>` where that name is taken, and a call
  comes back as OpenAI returns it, the member's own `name` plus `namespace` (Codex routes a
  call by both, and refuses the flattened name). Later turns send the call back the same way.
- `custom` (free-form) tools go to the model as a function of one string, `input` (a regex
  format becomes that string's pattern; a Lark grammar is shown in its description), and a
  call comes back as a `custom_tool_call` item whose `input` is that string, streamed with
  `response.custom_tool_call_input.delta`/`.done`.
- Hosted tools (web search, file search, code interpreter, ...) run on OpenAI's servers, which
  corral has not got: they are left out of the prompt (one info log line), and a `tool_choice`
  that forces one is a 400.

Reasoning: without `reasoning.effort` the model's template decides. Effort "none" or "minimal"
turns thinking off (enable_thinking false: templates know only on and off, and "minimal" asks
for as little as possible); any other effort turns it on and passes the effort to the template
as `reasoning_effort` (low/medium/high, which templates such as gpt-oss's read).

Logprobs come with the text when `include` has "message.output_text.logprobs" or
`top_logprobs` is set; other `include` values (e.g. "reasoning.encrypted_content") ask for
what corral has not got and are ignored, as are `prompt_cache_key`, `client_metadata`,
`safety_identifier`, `service_tier`, `reasoning.summary` and `text.verbosity`. Streamed and
whole answers go through the same `Builder` (not `Generation.collect`), so their items, ids,
statuses and reasoning-token counts agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from corral.api.chat import Chat
from corral.api.common import field as get
from corral.api.common import model_field
from corral.api.families.responses.render import ToolRef
from corral.api.families.responses.stored import stored_items
from corral.errors import ApiError
from corral.runtime.response_store import Stored

log = logging.getLogger(__name__)

OUTPUTS = ("function_call_output", "custom_tool_call_output")


ROLES = {"user": "user", "system": "system", "assistant": "assistant", "developer": "system"}


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")


# Tool types that OpenAI runs on its own servers (the SDK's Tool union less function, custom
# and namespace): corral cannot run them, so the model is not told of them.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview",
    "web_search_preview_2025_03_11", "file_search", "code_interpreter", "image_generation",
    "computer", "computer_use", "computer_use_preview", "mcp", "local_shell", "shell",
    "apply_patch", "tool_search", "programmatic_tool_calling",
})  # fmt: skip


@dataclass
class Parsed:
    """A validated request: the chat for the runner and what the response echoes back."""

    model: str
    stream: bool
    chat: Chat
    echo: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, ToolRef] = field(default_factory=dict)  # by the name the model sees
    store: bool = True
    items: list[dict[str, Any]] = field(default_factory=list)  # the input as stored


@dataclass
class Tools:
    """The request's tools: as the model sees them, as the response echoes them, and the way
    back from a name the model sees to the client's tool."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    echo: list[dict[str, Any]] = field(default_factory=list)
    refs: dict[str, ToolRef] = field(default_factory=dict)
    hosted: list[str] = field(default_factory=list)  # the types left out

    def visible(self, name: str, namespace: str | None) -> str:
        """The name the model sees for a client's tool (one from an earlier turn that is not
        offered now gets the name it would have had)."""
        for seen, ref in self.refs.items():
            if ref.name == name and ref.namespace == namespace:
                return seen
        return f"{namespace}__{name}" if namespace else name


def parse_request(body: dict[str, Any], base: Stored | None = None) -> Parsed:
    """The body checked field by field (400 naming the field) and turned into a Chat; `base`:
    the stored response it continues (`previous_response_id`)."""
    model = model_field(body)
    stream = get(body, "stream", bool, False)
    if body.get("conversation") is not None:
        raise ApiError(
            400,
            "conversation objects are not supported by corral: send the conversation in "
            "'input', or continue a stored response with 'previous_response_id'",
            "conversation",
        )
    if get(body, "background", bool):
        raise ApiError(400, "background responses are not supported by corral", "background")
    if body.get("prompt") is not None:
        raise ApiError(400, "stored prompts are not supported by corral", "prompt")

    instructions = get(body, "instructions", str)
    tools = parse_tools([("tools", get(body, "tools", list, [])), *additional_tools(body)])
    messages = input_messages(body.get("input"), tools)  # errors name the request's own items
    own: str | list[Any] = body["input"]  # a string or a list: checked
    if base is not None:
        # The stored conversation and then the new input, read as one (a tool output names
        # its call from the earlier turn), so the prompt continues the earlier one.
        items = [{"role": "user", "content": own}] if isinstance(own, str) else own
        messages = input_messages([*base.conversation(), *items], tools)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    messages = merge_leading_system(messages)
    choice, echo_choice = parse_tool_choice(body.get("tool_choice"), tools)

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
    if parallel is not None and tools.chat:
        params["parallel_tool_calls"] = parallel

    store = get(body, "store", bool, True)  # OpenAI's default: kept
    # Accepted and echoed; corral has nothing to do with them.
    metadata = get(body, "metadata", dict, {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ApiError(400, "invalid type for 'metadata': values must be strings", "metadata")
    get(body, "stream_options", dict)
    truncation = get(body, "truncation", str, "disabled")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_out,
        "max_tool_calls": get(body, "max_tool_calls", int),
        "metadata": metadata,
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": base.id if base is not None else None,
        "reasoning": {"effort": effort, "summary": reasoning.get("summary")},
        "service_tier": get(body, "service_tier", str, "default"),
        "store": store,
        "temperature": params.get("temperature"),
        "text": {**text, "format": fmt},
        "tool_choice": echo_choice,
        "tools": tools.echo,
        "top_logprobs": top,
        "top_p": params.get("top_p"),
        "truncation": truncation,
        "user": get(body, "user", str),
        "safety_identifier": get(body, "safety_identifier", str),
        "prompt_cache_key": get(body, "prompt_cache_key", str),
    }
    chat = Chat(messages, tools.chat, choice, params)
    items = stored_items(own) if store else []
    return Parsed(model, stream, chat, echo, tools.refs, store, items)


def input_messages(value: Any, tools: Tools | None = None) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as OpenAI chat messages; tool calls by the names
    the model sees (`tools`)."""
    if value is None:
        raise ApiError(400, "'input' is required: a string or an array of input items", "input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "invalid type for 'input': expected a string or an array", "input")
    if not value:
        raise ApiError(400, "'input' must not be empty", "input")
    tools = tools or Tools()
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    images: list[dict[str, Any]] = []  # from tool outputs, for a user message after them
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"invalid type for '{where}': expected an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if images and kind not in OUTPUTS:
            messages.append(images_message(images))
            images = []
        if kind == "message":
            messages.append(input_message(item, where))
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _str(item, "call_id", where)
            namespace = item.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise ApiError(
                    400, f"invalid type for '{where}.namespace': expected a string", "input"
                )
            name = tools.visible(_str(item, "name", where), namespace or None)
            if kind == "function_call":
                arguments = _str(item, "arguments", where)
            else:  # the model wrote it as the one string argument of a function
                arguments = orjson.dumps({"input": _str(item, "input", where)}).decode()
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            # Calls of one turn (and the text before them) are one assistant chat message.
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in OUTPUTS:
            call_id = _str(item, "call_id", where)
            out = item.get("output")
            if isinstance(out, str):
                content = out
            else:
                content, pictures = tool_output(out, f"{where}.output")
                images += pictures
            msg = {"role": "tool", "tool_call_id": call_id, "content": content}
            if call_id in names:
                msg["name"] = names[call_id]
            messages.append(msg)
        elif kind in ("reasoning", "additional_tools"):
            # Earlier reasoning is not shown to the model again (templates drop it); the tools
            # an additional_tools item brings are among the request's tools already.
            continue
        elif kind == "item_reference":
            raise ApiError(
                400,
                f"'{where}': item references are not supported by corral: send the item "
                "itself, or continue a stored response with 'previous_response_id'",
                "input",
            )
        else:
            raise ApiError(
                400,
                f"'{where}': input items of type '{kind}' are not supported (corral takes "
                "message, function_call, function_call_output, custom_tool_call, "
                "custom_tool_call_output, additional_tools and reasoning)",
                "input",
            )
    if images:
        messages.append(images_message(images))
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


def tool_output(value: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    """A tool call's output given as content parts: its text, and its images (Codex's
    view_image returns one), which a chat tool message cannot hold."""
    if not isinstance(value, list):
        raise ApiError(400, f"invalid type for '{where}': expected a string or an array", "input")
    parts = [content_part(p, f"{where}[{j}]") for j, p in enumerate(value)]
    images = [p for p in parts if p["type"] == "image_url"]
    text = "\n".join(p["text"] for p in parts if p["type"] == "text")
    if images and not text:
        text = "(an image: it follows)"
    return text, images


def images_message(images: list[dict[str, Any]]) -> dict[str, Any]:
    """The images of the tool outputs before it, as a user message: after all of a turn's
    tool messages, which templates want together right after the calls."""
    intro = {"type": "text", "text": "The images the tool calls above returned:"}
    return {"role": "user", "content": [intro, *images]}


def _str(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"'{where}.{name}' is required: a string", "input")
    return value


def additional_tools(body: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """The tools of `additional_tools` input items (Codex sends its tools so), each list with
    where it is."""
    items = body.get("input")
    found = []
    for i, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            tools = item.get("tools")
            if not isinstance(tools, list):
                raise ApiError(
                    400, f"invalid type for 'input[{i}].tools': expected an array", "input"
                )
            found.append((f"input[{i}].tools", tools))
    return found


def parse_tools(groups: list[tuple[str, list[Any]]]) -> Tools:
    """The request's tools (lists named by where they are: "tools", "input[0].tools") as the
    model sees them and as the response echoes them. A tool given again (a later
    additional_tools item) replaces the earlier one."""
    found: dict[tuple[str | None, str], tuple[ToolRef, dict[str, Any]]] = {}
    out = Tools()
    for where, tools in groups:
        param = "tools" if where == "tools" else "input"
        for i, t in enumerate(tools):
            at = f"{where}[{i}]"
            if not isinstance(t, dict):
                raise ApiError(400, f"invalid type for '{at}': expected an object", param)
            kind = t.get("type")
            if not isinstance(kind, str):
                raise ApiError(400, f"invalid type for '{at}.type': expected a string", param)
            if kind in HOSTED_TOOLS:
                out.hosted.append(str(kind))
                if where == "tools":
                    out.echo.append(t)
                continue
            if kind == "namespace":
                ns = _name(t, at, param)
                get(t, "description", str, prefix=f"{at}.")
                members = t.get("tools")
                if not isinstance(members, list) or not members:
                    raise ApiError(
                        400, f"'{at}.tools' is required: an array of function or custom tools",
                        param,
                    )  # fmt: skip
                for j, m in enumerate(members):
                    mat = f"{at}.tools[{j}]"
                    if not isinstance(m, dict) or m.get("type") not in ("function", "custom"):
                        raise ApiError(
                            400, f"'{mat}': a namespace holds only function and custom tools",
                            param,
                        )  # fmt: skip
                    ref, fn = _tool(m, mat, param, ns)
                    found[(ns, ref.name)] = (ref, fn)
                if where == "tools":
                    out.echo.append(t)
            elif kind in ("function", "custom"):
                ref, fn = _tool(t, at, param, None)
                found[(None, ref.name)] = (ref, fn)
                if where == "tools":
                    out.echo.append(_echo_function(t) if kind == "function" else t)
            else:
                raise ApiError(
                    400,
                    f"'{at}': tools of type '{kind}' are not supported (corral runs function, "
                    "custom and namespace tools, and leaves out OpenAI's hosted tools)",
                    param,
                )
    if out.hosted:
        log.info("leaving out hosted tools corral cannot run: %s", ", ".join(out.hosted))
    # A namespace's member keeps its own name unless another tool has it: Codex's prompts name
    # tools by their own names.
    plain = [ref.name for ref, _ in found.values()]
    for ref, fn in found.values():
        seen = ref.name
        if ref.namespace is not None and (plain.count(ref.name) > 1):
            seen = f"{ref.namespace}__{ref.name}"
        if seen in out.refs:
            raise ApiError(400, f"two tools have the name '{seen}'", "tools")
        out.refs[seen] = ref
        out.chat.append({"type": "function", "function": {**fn, "name": seen}})
    return out


def _name(t: dict[str, Any], where: str, param: str) -> str:
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"'{where}.name' is required: a string", param)
    return name


def _tool(
    t: dict[str, Any], where: str, param: str, namespace: str | None
) -> tuple[ToolRef, dict[str, Any]]:
    """A function or custom tool as a chat function (less the name the model will see)."""
    name = _name(t, where, param)
    desc = get(t, "description", str, prefix=f"{where}.")
    fn: dict[str, Any] = {"name": name}
    if desc is not None:
        fn["description"] = desc
    if t.get("type") == "custom":
        fmt = get(t, "format", dict, {"type": "text"}, prefix=f"{where}.")
        fn["parameters"] = custom_parameters(fmt, f"{where}.format", param)
        return ToolRef(name, namespace, custom=True), fn
    params = get(t, "parameters", dict, prefix=f"{where}.")
    strict = get(t, "strict", bool, prefix=f"{where}.")
    fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    if strict is not None:
        fn["strict"] = strict
    return ToolRef(name, namespace), fn


def _echo_function(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": t["name"],
        "description": t.get("description"),
        "parameters": t.get("parameters"),
        "strict": t.get("strict"),
    }


def custom_parameters(fmt: dict[str, Any], where: str, param: str) -> dict[str, Any]:
    """A custom tool's input as the one string argument, `input`, of a function. A regex
    format becomes the string's pattern (so a forced call matches it); a Lark grammar cannot
    be turned into a JSON schema, so the model is shown it."""
    text: dict[str, Any] = {"type": "string"}
    kind = fmt.get("type")
    if kind == "grammar":
        syntax = fmt.get("syntax")
        definition = fmt.get("definition")
        if syntax not in ("lark", "regex") or not isinstance(definition, str):
            raise ApiError(
                400,
                f"'{where}' must have a 'syntax' (lark or regex) and a 'definition' string",
                param,
            )
        if syntax == "regex":
            text["pattern"] = _anchored(definition)
        text["description"] = f"The input, which must match this {syntax} grammar:\n{definition}"
    elif kind == "text":
        text["description"] = "The input, as free-form text."
    else:
        raise ApiError(400, f"'{where}.type' must be text or grammar", param)
    return {
        "type": "object",
        "properties": {"input": text},
        "required": ["input"],
        "additionalProperties": False,
    }


def _anchored(regex: str) -> str:
    """A regex that must match the whole input, as OpenAI applies one (llama.cpp's schema
    converter takes only patterns anchored at both ends)."""
    core = regex.removeprefix("^")
    if core.endswith("$") and not core.endswith("\\$"):
        core = core[:-1]
    return f"^({core})$"


def parse_tool_choice(value: Any, tools: Tools) -> tuple[str, Any]:
    """tool_choice as Chat takes it ("auto", "none", "required" or the name the model sees),
    and as echoed."""
    if value is None:
        return "auto", "auto"
    if value in ("auto", "none", "required"):
        choice, echo = value, value
    elif isinstance(value, dict) and value.get("type") in ("function", "custom"):
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'tool_choice.name' is required: a string", "tool_choice")
        namespace = value.get("namespace")
        choice = choose_tool(tools, name, namespace if isinstance(namespace, str) else None)
        echo = value
    elif (
        isinstance(value, dict)
        and isinstance(value.get("type"), str)
        and value["type"] in HOSTED_TOOLS
    ):
        raise ApiError(
            400,
            f"'tool_choice' forces the hosted tool '{value['type']}', which runs on OpenAI's "
            "servers: corral cannot run it (it runs function, custom and namespace tools)",
            "tool_choice",
        )
    else:
        raise ApiError(
            400,
            '\'tool_choice\' must be "auto", "none", "required", {"type": "function", '
            '"name": ...} or {"type": "custom", "name": ...}',
            "tool_choice",
        )
    if choice not in ("auto", "none") and not tools.chat:
        why = "only hosted tools, which corral cannot run," if tools.hosted else "no tools"
        raise ApiError(
            400, f"'tool_choice' asks for a tool call but {why} were given", "tool_choice"
        )
    return choice, echo


def choose_tool(tools: Tools, name: str, namespace: str | None) -> str:
    """The name the model sees for the tool a tool_choice names by its own name (in
    `namespace` if given; else one in no namespace first). Another name is passed on as it
    is: it may be one the model sees."""
    matches = [
        seen
        for seen, ref in tools.refs.items()
        if ref.name == name and (namespace is None or ref.namespace == namespace)
    ]
    if len(matches) > 1:
        top = [seen for seen in matches if tools.refs[seen].namespace is None]
        if not top:
            raise ApiError(
                400,
                f"'tool_choice' names '{name}', which more than one namespace has: "
                "give its 'namespace' too",
                "tool_choice",
            )
        matches = top
    # Not found: the service answers that it is not among the tools.
    return matches[0] if matches else name


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
