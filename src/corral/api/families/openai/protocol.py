"""An OpenAI chat or completions body checked field by field, as llama.cpp will read it: a
wrong type, range or shape is a 400 naming the field, never a parse error or a 500 from the
runner (api/families/openai/routes.py)."""

from __future__ import annotations

from typing import Any

from corral.api.common import field
from corral.errors import ApiError

MAX_N = 16  # choices per request: each is a generation holding a runner slot


# What llama.cpp reads from a chat or completions body besides the fields checked on their
# own (OpenAI's and llama.cpp's own names), with the JSON type it takes: a wrong type is a 400
# naming the field here, not a parse error (or a 500) from the runner.
PARAM_TYPES: dict[str, type | tuple[type, ...]] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "typical_p": float,
    "top_n_sigma": float, "presence_penalty": float, "frequency_penalty": float,
    "repeat_penalty": float, "repeat_last_n": int, "max_tokens": int,
    "max_completion_tokens": int, "n_predict": int, "n_keep": int, "n_discard": int,
    "n_indent": int, "n_probs": int, "min_keep": int, "mirostat": int, "mirostat_tau": float,
    "mirostat_eta": float, "dynatemp_range": float, "dynatemp_exponent": float,
    "xtc_probability": float, "xtc_threshold": float, "dry_multiplier": float,
    "dry_base": float, "dry_allowed_length": int, "dry_penalty_last_n": int,
    "dry_sequence_breakers": list, "t_max_predict_ms": int, "n_cache_reuse": int,
    "id_slot": int, "n_cmpl": int, "stop": (str, list), "logit_bias": (dict, list),
    "grammar": str, "json_schema": dict, "response_format": dict, "samplers": (list, str),
    "cache_prompt": bool, "ignore_eos": bool, "user": str, "parallel_tool_calls": bool,
    "chat_template_kwargs": dict, "reasoning_format": str, "reasoning_effort": str,
    "timings_per_token": bool, "return_tokens": bool, "return_progress": bool,
    "post_sampling_probs": bool, "lora": list, "response_fields": list, "metadata": dict,
    "store": bool, "service_tier": str, "verbose": bool, "add_generation_prompt": bool,
    "grammar_lazy": bool, "backend_sampling": bool, "sse_ping_interval": int,
}  # fmt: skip
INT32 = 2**31 - 1
# Token counts llama.cpp keeps in 32 bits (-1: until the context is full). The others cost
# every client of the runner: n_probs is time on each token, the penalty windows are memory
# (DRY's 2**27 took 1 GiB). Other values out of range llama.cpp clamps or refuses itself.
PARAM_RANGES: dict[str, tuple[int, int]] = {
    "max_tokens": (-1, INT32), "max_completion_tokens": (-1, INT32), "n_predict": (-1, INT32),
    "n_probs": (0, 100), "repeat_last_n": (-1, 2**21), "dry_penalty_last_n": (-1, 2**21),
}  # fmt: skip
# Sizes llama.cpp pays for on the loop every slot of the runner shares: each DRY sequence
# breaker is matched against the whole vocabulary (500 of them held another client's request
# for 9 s), each sampler in the chain runs on every token.
PARAM_SIZES = {"dry_sequence_breakers": 8, "samplers": 16}


def check_params(body: dict[str, Any]) -> None:
    """Every sampling and llama.cpp field of a chat or completions body: type, range, shape."""
    for name, typ in PARAM_TYPES.items():
        value = field(body, name, typ)
        if name in PARAM_RANGES and value is not None:
            lo, hi = PARAM_RANGES[name]
            if not lo <= value <= hi:
                raise ApiError(400, f"'{name}' must be between {lo} and {hi}", name)
    # llama.cpp's slot and multi-completion controls would let one request hold slots the
    # scheduler gave to others: corral assigns slots, and `n` asks for several choices.
    if field(body, "id_slot", int, -1) != -1:
        raise ApiError(400, "'id_slot' is not supported: corral assigns runner slots", "id_slot")
    if field(body, "n_cmpl", int, 1) != 1:
        raise ApiError(400, "'n_cmpl' is not supported: use 'n'", "n_cmpl")
    stop = body.get("stop")
    if isinstance(stop, list) and not all(isinstance(x, str) for x in stop):
        raise ApiError(400, "invalid type for 'stop': expected a string or strings", "stop")
    for name in ("samplers", "dry_sequence_breakers", "response_fields"):
        value = body.get(name)
        if isinstance(value, list) and not all(isinstance(x, str) for x in value):
            raise ApiError(400, f"invalid type for '{name}': expected strings", name)
        if name in PARAM_SIZES and value is not None and len(value) > PARAM_SIZES[name]:
            raise ApiError(400, f"'{name}' may have at most {PARAM_SIZES[name]} entries", name)
    bias = body.get("logit_bias")
    pairs = bias.items() if isinstance(bias, dict) else bias or ()
    for pair in pairs:
        if (
            not isinstance(pair, list | tuple) or len(pair) != 2
            or not isinstance(pair[0], str | int) or isinstance(pair[0], bool)
            or not isinstance(pair[1], int | float)  # a bool is an int: false bans the token
        ):  # fmt: skip
            raise ApiError(
                400, "invalid 'logit_bias': expected token ids (or text) mapped to numbers",
                "logit_bias",
            )  # fmt: skip
    for i, adapter in enumerate(body.get("lora") or ()):
        if not isinstance(adapter, dict):
            raise ApiError(400, f"invalid type for 'lora[{i}]': expected an object", "lora")
        field(adapter, "id", int, prefix=f"lora[{i}].")
        field(adapter, "scale", float, prefix=f"lora[{i}].")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = field(fmt, "type", str, prefix="response_format.")
        if kind not in (None, "text", "json_object", "json_schema"):
            raise ApiError(
                400, "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                "response_format.type",
            )  # fmt: skip
        field(fmt, "schema", dict, prefix="response_format.")
        spec = field(fmt, "json_schema", dict, prefix="response_format.")
        if spec is not None:
            field(spec, "name", str, prefix="response_format.json_schema.")
            field(spec, "schema", dict, prefix="response_format.json_schema.")
            field(spec, "strict", bool, prefix="response_format.json_schema.")


def check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages as llama.cpp parses them; a wrong shape is a 400 naming the field (there
    it is a 500, "Failed to parse messages")."""
    messages: list[Any] = field(body, "messages", list)
    if not messages:
        raise ApiError(400, "'messages' is required and must not be empty", "messages")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"invalid type for '{at}': expected an object", at)
        if not field(m, "role", str, prefix=f"{at}."):
            raise ApiError(400, f"'{at}.role' is required", f"{at}.role")
        for name in ("name", "tool_call_id", "reasoning_content"):
            field(m, name, str, prefix=f"{at}.")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                _content_part(part, f"{at}.content[{j}]")
        elif content is not None and not isinstance(content, str):
            raise ApiError(
                400, f"invalid type for '{at}.content': expected a string or an array",
                f"{at}.content",
            )  # fmt: skip
        for j, call in enumerate(field(m, "tool_calls", list, [], prefix=f"{at}.")):
            where = f"{at}.tool_calls[{j}]"
            if not isinstance(call, dict):
                raise ApiError(400, f"invalid type for '{where}': expected an object", where)
            field(call, "id", str, prefix=f"{where}.")
            if call.get("type") != "function":
                raise ApiError(400, f"'{where}.type' must be 'function'", f"{where}.type")
            fn = field(call, "function", dict, prefix=f"{where}.")
            if fn is None or not field(fn, "name", str, prefix=f"{where}.function."):
                raise ApiError(
                    400, f"'{where}.function.name' is required", f"{where}.function.name"
                )
            field(fn, "arguments", (str, dict), prefix=f"{where}.function.")
    return messages


def _content_part(part: Any, at: str) -> None:
    if not isinstance(part, dict):
        raise ApiError(400, f"invalid type for '{at}': expected an object", at)
    kind = field(part, "type", str, prefix=f"{at}.")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise ApiError(400, f"'{at}.text' is required: a string", f"{at}.text")
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ApiError(400, f"'{at}.image_url.url' is required: a string", f"{at}.image_url")


def stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = field(body, "stream", bool, False)
    opts = field(body, "stream_options", dict, {})
    include = field(opts, "include_usage", bool, False, prefix="stream_options.")
    return stream, include


def int_in(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = field(body, name, int)
    if value is not None and not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}", name)
    return value


def choice_count(body: dict[str, Any]) -> int:
    n = int_in(body, "n", 1, MAX_N)
    return 1 if n is None else n


def check_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools: list[Any] = field(body, "tools", list, [])
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ApiError(400, f"invalid type for '{at}': expected an object", at)
        if tool.get("type") != "function":
            raise ApiError(400, f"'{at}.type' must be 'function'", f"{at}.type")
        fn = field(tool, "function", dict, prefix=f"{at}.")
        if fn is None:
            raise ApiError(400, f"'{at}.function' is required", f"{at}.function")
        if not field(fn, "name", str, prefix=f"{at}.function."):
            raise ApiError(400, f"'{at}.function.name' is required", f"{at}.function.name")
        field(fn, "description", str, prefix=f"{at}.function.")
        field(fn, "parameters", dict, prefix=f"{at}.function.")
    return tools


def tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    """`auto`, `none`, `required` or the name of the function the answer must call."""
    value = body.get("tool_choice")
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ApiError(
                400, "'tool_choice' must be 'auto', 'none', 'required' or a function",
                "tool_choice",
            )  # fmt: skip
        choice = value
    elif isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type") != "function" or not isinstance(name, str) or not name:
            raise ApiError(
                400, "'tool_choice' must be {\"type\": \"function\", \"function\": "
                "{\"name\": ...}} when it is an object", "tool_choice",
            )  # fmt: skip
        choice = name
    else:
        raise ApiError(400, "invalid type for 'tool_choice': expected a string or an object",
                       "tool_choice")  # fmt: skip
    if choice not in ("auto", "none") and not tools:
        raise ApiError(
            400, "'tool_choice' is only allowed when 'tools' are specified", "tool_choice"
        )
    return choice


def check_prompts(prompt: str | list[Any], name: str = "prompt") -> list[str | list[int]]:
    """The prompts of a completions request (a string, strings, tokens, or token arrays)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token(t) for t in prompt):
        return [prompt]
    out: list[str | list[int]] = []
    for p in prompt:
        if isinstance(p, str) or (isinstance(p, list) and all(_is_token(t) for t in p)):
            out.append(p)
        else:
            raise ApiError(
                400, f"'{name}' must be a string, an array of strings, an array of tokens or "
                "an array of token arrays", name,
            )  # fmt: skip
    return out


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
