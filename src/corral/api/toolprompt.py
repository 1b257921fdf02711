"""Tool calls for models whose chat template knows no tools (as LM Studio does for them).

llama.cpp renders such a template without the tools, so the model never sees them. corral
does it itself, in Hermes' words (the format most small instruction models have seen):

- `instructions` is a system-prompt section listing the tools as JSON schemas and saying how to
  call one: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `fallback_messages`
  puts it in the conversation and turns earlier calls and tool results into plain text the
  template can render (an assistant turn with the call, a user turn with `<tool_response>`).
- `template_body` is what llama.cpp's /apply-template renders a chat from: as it is for a
  template that knows tools, with `fallback_messages` for one that does not.
- `call_grammar` is a GBNF grammar of one call to one of the tools (its arguments shaped by the
  tool's JSON schema), sent to llama.cpp's /completion as a lazy grammar triggered by
  `TRIGGER`: the model writes freely until it starts a call, and from the trigger on the call
  is constrained (`fallback_grammar`: /completion's fields for it).
- `CallScanner` finds the calls in the generated text as it streams: text before a trigger
  passes on at once (less a possible start of the trigger), a call is held until its closing
  tag and then parsed; one that does not parse stays text.

Everything here is pure (no I/O), so it is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from corral.api.chat import Chat

TRIGGER = "<tool_call>"
CLOSE = "</tool_call>"


def instructions(tools: list[dict[str, Any]]) -> str:
    """The system-prompt section that shows the model the tools and how to call one."""
    listed = "\n".join(orjson.dumps(t, option=orjson.OPT_NON_STR_KEYS).decode() for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {TRIGGER}{CLOSE} XML tags:\n"
        f'{TRIGGER}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )


def fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` for a template without tools: the tools' section appended to the first
    system message (or a system message of its own first), each assistant tool call as a
    `<tool_call>` block in its message's text, and tool results as user turns of
    `<tool_response>` blocks (consecutive results in one turn)."""
    out: list[dict[str, Any]] = []
    section = instructions(tools) if tools else ""
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_results"):
                prev["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"] if isinstance(c, dict)]
            text = _text(m.get("content"))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = "\n".join([text, *blocks] if text else blocks)
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if section:
        if out and out[0].get("role") == "system":
            first = dict(out[0])
            content = first.get("content")
            if isinstance(content, list):
                first["content"] = [*content, {"type": "text", "text": "\n\n" + section}]
            else:
                first["content"] = f"{_text(content)}\n\n{section}" if content else section
            out[0] = first
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def template_body(
    chat: Chat, fallback: bool, forced: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """What /apply-template renders `chat` from: its messages and tools as they are, or, for a
    template without tools (`fallback`), the messages with the tools (the forced ones, when the
    call is forced) shown by corral and earlier calls and results as text."""
    if fallback:
        return {"messages": fallback_messages(chat.messages, forced or chat.tools)}
    body: dict[str, Any] = {"messages": chat.messages}
    if chat.tools and chat.tool_choice != "none":
        body["tools"] = chat.tools
    return body


def _text(content: Any) -> str:
    """A message's content as text (OpenAI content parts joined; None as nothing)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return str(content)


def _call_block(call: dict[str, Any]) -> str:
    inner = call.get("function")
    fn: dict[str, Any] = inner if isinstance(inner, dict) else call
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError:
            pass  # kept as the text it is
    body = {"name": fn.get("name", ""), "arguments": args}
    return f"{TRIGGER}\n{orjson.dumps(body).decode()}\n{CLOSE}"


# ---- the grammar of a call -----------------------------------------------------------------

# JSON, as GBNF: a value of any shape, and the pieces the schema rules are made of.
_BASE = {
    "ws": '| " " | "\\n" [ ]{0,8}',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* )? ws "}"',
    "array": '"[" ws ( value ( ws "," ws value )* )? ws "]"',
    "string": '"\\"" char* "\\""',
    "char": '[^"\\\\\\x7F\\x00-\\x1F] | "\\\\" ( ["\\\\/bfnrt] | "u" [0-9a-fA-F]{4} )',
    "integer": '"-"? ( [0-9] | [1-9] [0-9]{1,15} )',
    "number": 'integer ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,15} )?',
    "boolean": '"true" | "false"',
    "null": '"null"',
}
_TYPES = {"string", "integer", "number", "boolean", "null", "object", "array"}
MAX_DEPTH = 12  # nested schemas (and $refs) deeper than this take any JSON value
MAX_OPTIONAL = 16  # objects with more optional properties take any properties


def lit(text: str) -> str:
    """A GBNF string literal matching exactly `text`."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _json_lit(value: Any) -> str:
    """A GBNF literal of `value` as compact JSON."""
    return lit(orjson.dumps(value).decode())


class _Grammar:
    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self.defs: dict[str, str] = {}  # an expression's text -> the rule naming it

    def rule(self, hint: str, expr: str) -> str:
        """The name of a rule for `expr` (the same rule for the same expression)."""
        if expr in self.defs:
            return self.defs[expr]
        name, i = hint, 1
        while name in self.rules or name in _BASE:
            i += 1
            name = f"{hint}-{i}"
        self.rules[name] = expr
        self.defs[expr] = name
        return name

    def schema(self, s: Any, hint: str, root: dict[str, Any], depth: int = 0) -> str:
        """An expression matching JSON that `s` allows (any JSON value where the schema says
        something this converter does not follow)."""
        if not isinstance(s, dict) or depth > MAX_DEPTH:
            return "value"
        if "$ref" in s:
            target = _resolve(root, s["$ref"])
            return self.schema(target, hint, root, depth + 1) if target is not None else "value"
        if "const" in s:
            return _json_lit(s["const"])
        if isinstance(s.get("enum"), list) and s["enum"]:
            return "( " + " | ".join(_json_lit(v) for v in s["enum"]) + " )"
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                alts = [self.schema(a, f"{hint}-{i}", root, depth + 1)
                        for i, a in enumerate(s[key])]  # fmt: skip
                return "( " + " | ".join(alts) + " )"
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) == 1:
            return self.schema(s["allOf"][0], hint, root, depth + 1)
        t = s.get("type")
        if isinstance(t, list):
            alts = [self.schema({**s, "type": x}, f"{hint}-{x}", root, depth + 1)
                    for x in t if isinstance(x, str) and x in _TYPES]  # fmt: skip
            return "( " + " | ".join(alts) + " )" if alts else "value"
        if t is None and isinstance(s.get("properties"), dict):
            t = "object"
        if t == "object":
            return self._object(s, hint, root, depth)
        if t == "array":
            item = self.schema(s.get("items"), f"{hint}-item", root, depth + 1)
            return self.rule(hint, f'"[" ws ( {item} ( ws "," ws {item} )* )? ws "]"')
        if isinstance(t, str) and t in _TYPES:
            return t
        return "value"

    def _object(self, s: dict[str, Any], hint: str, root: dict[str, Any], depth: int) -> str:
        props = s.get("properties")
        if not isinstance(props, dict) or not props:
            return "object"
        required: list[Any] = s["required"] if isinstance(s.get("required"), list) else []
        names = [k for k in props if isinstance(k, str)]
        req = [k for k in names if k in required]
        opt = [k for k in names if k not in required]
        if len(opt) > MAX_OPTIONAL:
            return "object"

        def kv(k: str) -> str:
            value = self.schema(props[k], f"{hint}-{_name(k)}", root, depth + 1)
            return f'{_json_lit(k)} ws ":" ws {value}'

        # The optional ones in their order, each present or not: rest(i) is what may follow
        # once a property before opt[i] is written.
        rest = [""] * (len(opt) + 1)
        for i in range(len(opt) - 1, -1, -1):
            tail = f" {rest[i + 1]}" if rest[i + 1] else ""
            rest[i] = self.rule(f"{hint}-rest", f'( ws "," ws {kv(opt[i])} )?{tail}')
        if req:
            body = ' ws "," ws '.join(kv(k) for k in req) + (f" {rest[0]}" if rest[0] else "")
        else:
            firsts = [kv(k) + (f" {rest[i + 1]}" if rest[i + 1] else "") for i, k in enumerate(opt)]
            body = "( " + " | ".join(firsts) + " )?"
        return self.rule(hint, f'"{{" ws {body} ws "}}"')


def _name(key: str) -> str:
    """A rule-name piece from a property name (GBNF names are letters, digits and dashes)."""
    out = "".join(c if c.isascii() and c.isalnum() else "-" for c in key).strip("-")
    return out[:24] or "p"


def _resolve(root: dict[str, Any], ref: Any) -> Any:
    """A local `#/...` reference inside the tool's parameters schema (None if not found)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref.lstrip("#").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def call_grammar(tools: list[dict[str, Any]]) -> str:
    """A GBNF grammar of one `<tool_call>` block calling one of `tools`, its arguments
    shaped by the tool's parameters schema."""
    g = _Grammar()
    calls = []
    for i, t in enumerate(tools):
        inner = t.get("function")
        fn: dict[str, Any] = inner if isinstance(inner, dict) else {}
        params = fn.get("parameters")
        params = params if isinstance(params, dict) and params else {"type": "object"}
        args = g.schema(params, f"args{i}", params)
        head = '"{" ws ' + lit('"name"') + ' ws ":" ws '
        calls.append(g.rule(
            f"call{i}",
            head + _json_lit(str(fn.get("name", ""))) + ' ws "," ws ' + lit('"arguments"')
            + f' ws ":" ws {args} ws "}}"',
        ))  # fmt: skip
    lines = [f"root ::= {lit(TRIGGER)} ws ( {' | '.join(calls)} ) ws {lit(CLOSE)}"]
    lines += [f"{name} ::= {expr}" for name, expr in g.rules.items()]
    lines += [f"{name} ::= {expr}" for name, expr in _BASE.items()]
    return "\n".join(lines) + "\n"


# ---- finding calls in the text -------------------------------------------------------------


def fallback_grammar(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """/completion's fields for a call that a template without tools may start: free text
    until the model writes the trigger, then one call to one of `tools` (a lazy grammar)."""
    return {
        "grammar": call_grammar(tools),
        "grammar_lazy": True,
        # llama.cpp's COMMON_GRAMMAR_TRIGGER_TYPE_WORD: the trigger anywhere in the text
        "grammar_triggers": [{"type": 1, "value": TRIGGER}],
        # Where the tags are special tokens of the vocabulary, llama.cpp wants a trigger among
        # these, and then writes them as text (a tag of several tokens is ignored here).
        "preserved_tokens": [TRIGGER, CLOSE],
    }


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


def parse_call(body: str, names: frozenset[str] | None = None) -> Call | None:
    """The call in a `<tool_call>` block's body, or None if it is not one: JSON of an object
    with a string `name` (one of `names`, if given) and an object `arguments` (or
    `parameters`; JSON text of one; none at all is no arguments)."""
    try:
        data = orjson.loads(body.strip())
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(name, orjson.dumps(args).decode())


def _partial(text: str, word: str) -> int:
    """How many characters at the end of `text` may be the start of `word`."""
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


class CallScanner:
    """Tool calls in streamed text. `feed` returns what may go on now: text (str) and calls
    (`Call`); `finish` what is left at the end. Text is held back only while it may be the
    start of `TRIGGER`, or is whitespace that may come before a call (whitespace around calls
    is dropped); a call is held from its trigger to its closing tag, then parsed: a block that
    is not a call goes on as the text it was. At the end, a call whose closing tag never came
    counts if its JSON is whole."""

    def __init__(self, names: frozenset[str] | None = None) -> None:
        self.names = names
        self.buf = ""  # text not passed on yet
        self.in_call = False  # buf starts with TRIGGER
        self.space = ""  # the whitespace before the call being read
        self.after_call = False  # nothing but whitespace went on since the last call
        self.calls = 0

    def feed(self, text: str) -> list[str | Call]:
        self.buf += text
        out: list[str | Call] = []
        while self.buf:
            if not self.in_call:
                if self.after_call:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    self.after_call = False
                i = self.buf.find(TRIGGER)
                if i < 0:
                    keep = _partial(self.buf, TRIGGER)
                    safe = self.buf[: len(self.buf) - keep].rstrip()
                    if safe:
                        out.append(safe)
                        self.buf = self.buf[len(safe) :]
                    break
                before = self.buf[:i]
                if text := before.rstrip():
                    out.append(text)
                self.space = before[len(text) :]
                self.buf = self.buf[i:]
                self.in_call = True
            j = self.buf.find(CLOSE, len(TRIGGER))
            if j < 0:
                break
            block, self.buf = self.buf[: j + len(CLOSE)], self.buf[j + len(CLOSE) :]
            self.in_call = False
            out.append(self._call(block[len(TRIGGER) : j]) or self.space + block)
            self.space = ""
        return out

    def finish(self) -> list[str | Call]:
        rest, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            call = self._call(rest[len(TRIGGER) :])
            return [call] if call is not None else [self.space + rest]
        if self.after_call and not rest.strip():
            return []
        return [rest] if rest else []

    def _call(self, body: str) -> Call | None:
        call = parse_call(body, self.names)
        if call is not None:
            self.calls += 1
            self.after_call = True
        return call
