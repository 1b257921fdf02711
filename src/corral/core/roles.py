"""Where system messages go in a conversation.

Clients put system messages after the conversation has begun (Claude Code sends one in
`messages` on every request). Many chat templates render such a message as a system turn in
place; others refuse it ("roles must alternate") or drop it. So a template is probed once:
where it renders a later system message in place, the message stays; elsewhere it is folded
into the adjacent user turn (the next one, else the one before), never into the leading system
prompt, whose tokens would then change and void the prompt cache of every later turn.
"""

from __future__ import annotations

import functools
from typing import Any

from corral.core.gotemplate import TemplateError, render

_U1, _A1, _S2, _U2 = "corral-probe-u1", "corral-probe-a1", "corral-probe-s2", "corral-probe-u2"


@functools.lru_cache(maxsize=64)
def renders_later_system(template: str | None) -> bool:
    """Whether `template` renders a system message that follows an assistant turn, in place.
    None (the GGUF has no template) is llama.cpp's ChatML fallback, which renders any role."""
    if template is None:
        return True
    probe = [
        {"role": "user", "content": _U1},
        {"role": "assistant", "content": _A1},
        {"role": "system", "content": _S2},
        {"role": "user", "content": _U2},
    ]
    try:
        out = render(template, probe)
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError):
        # Rendered by jinja2, not llama.cpp's engine: a template that reads what the probe
        # does not give (tools, say) fails here and is folded for, which every template takes.
        return False
    return -1 < out.find(_A1) < out.find(_S2) < out.find(_U2)


def has_later_system(messages: list[dict[str, Any]]) -> bool:
    """Whether a system message follows the conversation's first other message."""
    begun = False
    for m in messages:
        if m.get("role") != "system":
            begun = True
        elif begun:
            return True
    return False


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content or [] if p.get("type") == "text")


def _join(content: Any, text: str, before: bool) -> Any:
    """`text` added to a message's content (a string, or parts with images) before or after."""
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        return [part, *content] if before else [*content, part]
    content = content or ""
    if not content:
        return text
    return f"{text}\n\n{content}" if before else f"{content}\n\n{text}"


def place_system(messages: list[dict[str, Any]], in_place: bool) -> list[dict[str, Any]]:
    """OpenAI-style `messages` with every system message where the template can take it: the
    leading ones merged into one system prompt (templates read only the first), later ones
    kept (`in_place`) or folded into the adjacent user turn."""
    lead: list[str] = []
    i = 0
    while i < len(messages) and messages[i].get("role") == "system":
        lead.append(_text(messages[i].get("content")))
        i += 1
    out: list[dict[str, Any]] = []
    if any(lead):
        out.append({"role": "system", "content": "\n\n".join(t for t in lead if t)})
    pending: list[str] = []  # later system texts waiting for the next user turn
    for m in messages[i:]:
        if m.get("role") == "system" and not in_place:
            pending.append(_text(m.get("content")))
            continue
        if m.get("role") == "user" and pending:
            m = {**m, "content": _join(m.get("content"), "\n\n".join(pending), before=True)}
            pending = []
        out.append(m)
    if pending:  # none followed: the last user turn takes them, else the system prompt
        text = "\n\n".join(pending)
        for k in range(len(out) - 1, -1, -1):
            if out[k].get("role") == "user":
                out[k] = {**out[k], "content": _join(out[k].get("content"), text, before=False)}
                break
        else:
            if out and out[0].get("role") == "system":
                out[0] = {"role": "system", "content": _join(out[0]["content"], text, False)}
            else:
                out.insert(0, {"role": "system", "content": text})
    return out
