"""What every generating API family shares, as types only: the neutral request (`Chat`, what
each family's request becomes), the neutral events a generation yields (`Text`, `Thinking`,
`ToolCall`, `Done`: `Event`) and a whole answer (`Result`).

A family renders every event: each renderer dispatches with one `match` over `Event` that ends
in `unhandled(ev)`, so an event type added here fails mypy in every renderer that does not
handle it (api/events.Generation yields them; the renderers are in each family's output
module). `RawText` is not an `Event`: it is Ollama's plain fast path (`Generation.batches`),
which only a renderer that asks for it gets.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, NoReturn

# ---- the neutral request -------------------------------------------------------------------


@dataclass
class Chat:
    """A chat request in llama.cpp's terms (its /v1/chat/completions body, less streaming).

    `tool_choice` is "auto", "none", "required" or a tool name; `params` go to llama.cpp as
    they are (max_tokens, temperature, top_p, top_k, stop, seed, response_format,
    chat_template_kwargs, logprobs, ...)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools one of which the answer must call, or None when the model may choose."""
        if not self.tools or self.tool_choice in ("auto", "none"):
            return None
        if self.tool_choice == "required":
            return self.tools
        return [t for t in self.tools if tool_name(t) == self.tool_choice]


def tool_name(tool: dict[str, Any]) -> str:
    fn = tool.get("function")
    return str(fn.get("name", "")) if isinstance(fn, dict) else ""


# ---- the neutral events --------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    text: str
    # llama.cpp's per-token entries ({token, logprob, bytes, top_logprobs}) when asked for
    logprobs: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Thinking:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A tool call's start (name and id set) or a piece of its JSON arguments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0


@dataclass(frozen=True)
class Done:
    """The end of a generation: why it stopped ("stop", "length" or "tool_calls"), the stop
    sequence that ended it if one did, and the token counts."""

    reason: str
    usage: Usage
    stop_sequence: str | None = None


Event = Text | Thinking | ToolCall | Done


@dataclass(frozen=True)
class RawText:
    """A content-only chat delta as llama.cpp wrote it: its text's JSON string literal, which
    is exactly what orjson writes for that text (`Generation.batches(plain=True)`), so a
    renderer may put it in its own JSON as it is."""

    literal: bytes


def unhandled(ev: NoReturn) -> NoReturn:
    """The end of a renderer's `match` over `Event`: mypy fails where an event is not
    handled."""
    raise AssertionError(f"an event no renderer handles: {ev!r}")


@dataclass
class Result:
    """A whole generation, for non-streamed answers."""

    text: str
    thinking: str
    tool_calls: list[dict[str, str]]  # {"id", "name", "arguments" (JSON text)}
    done: Done
    logprobs: list[dict[str, Any]]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"
