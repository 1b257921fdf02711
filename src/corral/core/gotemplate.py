"""Ollama's Go chat templates as Jinja chat templates, so llama.cpp renders a created model's
TEMPLATE (Modelfile / `/api/create`) the way Ollama renders it.

Ollama executes the template with `.System` (the system messages joined), `.Messages`
(`.Role`, `.Content`, `.ToolCalls`...), `.Tools` and `.Response` = "" when it mentions
`.Messages`; otherwise ("legacy" templates of `.System`, `.Prompt`, `.Response`) once per
round of the conversation, the last round cut after `.Response` (ollama template.Execute).
Both are written here as one Jinja template over llama.cpp's `messages` and `tools`.

Every piece of literal text is emitted as a string expression, never as raw template text:
llama.cpp renders with trim_blocks/lstrip_blocks (as Hugging Face does), which would eat the
newlines Go keeps. Go's `{{-`/`-}}` trimming is applied here, at translation time.

Supported: text, `{{ pipeline }}`, `if`/`else if`/`else`, `range` (lists, `$i, $x :=`, maps
`$k, $v :=`), `with`, `$x := ...` / `$x = ...`, `continue`, comments, and the
functions Ollama's templates use: eq ne lt le gt ge and or not len slice index printf print
json currentDate yesterdayDate. Anything else raises TemplateError naming it. The template is
parsed by `core/goparse.py`; this module translates and renders it."""

from __future__ import annotations

import datetime
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from corral.core.goparse import (
    Action,
    Control,
    If,
    Node,
    Pipe,
    Range,
    TemplateError,
    Term,
    Text,
    With,
    parse,
)

__all__ = ["TemplateError", "is_jinja", "render", "to_jinja"]


def is_jinja(text: str) -> bool:
    """A Jinja chat template (as in a GGUF's tokenizer.chat_template) rather than Go's."""
    return "{%" in text or bool(re.search(r"\{\{-?\s*(messages|bos_token|message)\b", text))


ROOT_FIELDS = {
    "System": "_g.system",
    "Messages": "messages",
    "Tools": "tools",
    "Prompt": "_prompt",
    "Response": "_response",
    "Suffix": '""',
    "Think": "(enable_thinking is defined and enable_thinking)",
    "IsThinkSet": "(enable_thinking is defined)",
    "ThinkLevel": '""',
}
# Ollama's message fields under llama.cpp's names (the rest: CamelCase -> snake_case)
FIELD_NAMES = {"Thinking": "reasoning_content", "ToolName": "name", "ToolCallID": "tool_call_id"}
JSON_FIELDS = {"Arguments", "Parameters", "Properties", "Items", "Enum"}
_SNAKE = re.compile(r"(?<=[a-z0-9])([A-Z])")


def _field(name: str) -> str:
    return FIELD_NAMES.get(name) or _SNAKE.sub(r"_\1", name).lower()


def _lit(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + out.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t") + '"'


@dataclass
class _Scope:
    dot: str  # the Jinja expression of Go's dot ("" at the root)
    names: dict[str, str]  # Go variable -> Jinja expression


class _Writer:
    def __init__(self) -> None:
        self.vars: set[str] = set()
        self.n = 0

    def fresh(self, stem: str) -> str:
        self.n += 1
        return f"_{stem}{self.n}"

    # -- expressions
    def chain(self, base: str, names: tuple[str, ...], root: bool = False) -> str:
        expr = base
        for i, name in enumerate(names):
            if root and i == 0:
                if name not in ROOT_FIELDS:
                    raise TemplateError(f"unknown field .{name}")
                expr = ROOT_FIELDS[name]
            else:
                expr = f"{expr}.{_field(name)}" if expr else _field(name)
        return expr

    def term(self, t: Term, sc: _Scope) -> str:
        if t.kind == "str":
            return _lit(str(t.value))
        if t.kind == "num":
            return str(t.value)
        if t.kind == "bool":
            return "true" if t.value else "false"
        if t.kind == "nil":
            return "none"
        if t.kind == "dot":
            if not sc.dot:
                raise TemplateError("the root dot itself cannot be used")
            return sc.dot
        if t.kind == "field":
            return self.chain(sc.dot, t.chain, root=not sc.dot)
        if t.kind == "root":
            if not t.chain:
                raise TemplateError("$ itself cannot be used")
            return self.chain("", t.chain, root=True)
        if t.kind == "var":
            name = str(t.value)
            if name not in sc.names:
                raise TemplateError(f"undefined variable ${name}")
            return self.chain(sc.names[name], t.chain)
        if t.kind == "paren":
            assert isinstance(t.value, Pipe)
            return self.chain(f"({self.pipe(t.value, sc)})", t.chain)
        if t.kind == "func":  # a function without arguments
            return self.call(str(t.value), [], sc)
        raise TemplateError(f"unexpected {t.kind}")

    def call(self, fn: str, args: list[str], sc: _Scope) -> str:
        def need(n: int) -> None:
            if len(args) < n:
                raise TemplateError(f"{fn} needs {n} argument(s)")

        if fn == "eq":
            need(2)
            return "(" + " or ".join(f"{args[0]} == {b}" for b in args[1:]) + ")"
        ops = {"ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
        if fn in ops:
            need(2)
            return f"({args[0]} {ops[fn]} {args[1]})"
        if fn in ("and", "or"):
            need(1)
            return "(" + f" {fn} ".join(args) + ")"
        if fn == "not":
            need(1)
            return f"(not {args[0]})"
        if fn == "len":
            need(1)
            return f"({args[0]}|length)"
        if fn == "index":
            need(2)
            return args[0] + "".join(f"[{a}]" for a in args[1:])
        if fn == "slice":
            need(1)
            lo = args[1] if len(args) > 1 else ""
            hi = args[2] if len(args) > 2 else ""
            return f"{args[0]}[{lo}:{hi}]"
        if fn == "json":
            need(1)
            return f"({args[0]}|tojson)"
        if fn == "print":
            return "(" + " ~ ".join(args or ['""']) + ")"
        if fn in ("currentDate", "yesterdayDate"):
            return '(strftime_now("%Y-%m-%d"))'
        raise TemplateError(f"function {fn!r} is not supported")

    def printf(self, fmt: Term, args: list[str]) -> str:
        if fmt.kind != "str":
            raise TemplateError("printf needs a literal format")
        parts, it = [], iter(args)
        for lit, verb in re.findall(r"((?:[^%]|%%)*)(%[sdvq]|$)", str(fmt.value)):
            if lit:
                parts.append(_lit(lit.replace("%%", "%")))
            if verb:
                arg = next(it, None)
                if arg is None:
                    raise TemplateError("printf has fewer arguments than verbs")
                parts.append(f"({arg}|tojson)" if verb == "%q" else f"({arg}|string)")
        return "(" + (" ~ ".join(parts) or '""') + ")"

    def command(self, cmd: list[Term], piped: str | None, sc: _Scope) -> str:
        head = cmd[0]
        if head.kind == "func":
            fn = str(head.value)
            if fn == "printf":
                if len(cmd) < 2:
                    raise TemplateError("printf needs a format")
                rest = [self.term(t, sc) for t in cmd[2:]]
                return self.printf(cmd[1], rest + ([piped] if piped else []))
            args = [self.term(t, sc) for t in cmd[1:]] + ([piped] if piped else [])
            return self.call(fn, args, sc)
        if len(cmd) > 1 or piped is not None:
            raise TemplateError("only a function can take arguments")
        return self.term(head, sc)

    def pipe(self, p: Pipe, sc: _Scope) -> str:
        out: str | None = None
        for cmd in p.commands:
            out = self.command(cmd, out, sc)
        assert out is not None
        return out

    def printed(self, p: Pipe, sc: _Scope) -> str:
        """How a printed value looks: Ollama's argument and schema objects print as JSON."""
        expr = self.pipe(p, sc)
        last = p.commands[-1]
        if len(p.commands) == 1 and len(last) == 1 and last[0].chain:
            if last[0].chain[-1] in JSON_FIELDS:
                return f"{{{{ {expr}|tojson }}}}"
        if len(p.commands) == 1 and len(last) == 1 and last[0].kind == "dot":
            return f"{{{{ _show({expr}) }}}}"  # a tool or a call printed whole: JSON
        return f"{{{{ {expr} }}}}"

    # -- statements
    def nodes(self, nodes: list[Node], sc: _Scope) -> str:
        return "".join(self.node(n, sc) for n in nodes)

    def node(self, n: Node, sc: _Scope) -> str:
        if isinstance(n, Text):
            return "{{ " + _lit(n.text) + " }}"
        if isinstance(n, Control):  # removed from range bodies by _no_continue
            raise TemplateError(f"{{{{ {n.word} }}}} outside range")
        if isinstance(n, Action):
            p = n.pipe
            if not p.assign:
                return self.printed(p, sc)
            if len(p.decl) != 1:
                raise TemplateError("only one variable can be assigned")
            name = p.decl[0]
            value = self.pipe(p, sc)
            if p.assign == ":=" or name not in sc.names:
                self.vars.add(name)
                sc.names[name] = f"_v.{name}"
            return f"{{% set {sc.names[name]} = {value} %}}"
        if isinstance(n, If):
            out = ""
            for i, (cond, body) in enumerate(n.branches):
                word = "if" if i == 0 else "elif"
                out += f"{{% {word} {self.pipe(cond, sc)} %}}" + self.nodes(body, _sub(sc))
            if n.otherwise is not None:
                out += "{% else %}" + self.nodes(n.otherwise, _sub(sc))
            return out + "{% endif %}"
        if isinstance(n, With):
            tmp = self.fresh("w")
            out = f"{{% set {tmp} = {self.pipe(n.pipe, sc)} %}}{{% if {tmp} %}}"
            out += self.nodes(n.body, _Scope(tmp, dict(sc.names)))
            if n.otherwise is not None:
                out += "{% else %}" + self.nodes(n.otherwise, _sub(sc))
            return out + "{% endif %}"
        assert isinstance(n, Range)
        items = self.pipe(Pipe(n.pipe.commands), sc)
        inner = _sub(sc)
        it = self.fresh("it")
        head, pre = f"{{% for {it} in {items} %}}", ""
        decl = n.pipe.decl
        if len(decl) == 1:
            inner.names[decl[0]] = it
        elif len(decl) == 2:  # index (or a map's key), element
            key = self.fresh("k")
            if _is_map(items):
                head = f"{{% for {key}, {it} in {items}|dictsort %}}"
            else:
                pre = f"{{% set {key} = loop.index0 %}}"
            inner.names[decl[0]] = key
            inner.names[decl[1]] = it
        inner.dot = it
        out = head + pre + self.nodes(_no_continue(n.body), inner)
        if n.otherwise is not None:
            out += "{% else %}" + self.nodes(n.otherwise, _sub(sc))
        return out + "{% endfor %}"


def _continues(n: Node) -> bool:
    """Whether a `continue` of the enclosing range is inside n (not in a nested range)."""
    if isinstance(n, Control):
        return True
    if isinstance(n, If):
        bodies = [b for _, b in n.branches] + [n.otherwise or []]
    elif isinstance(n, With):
        bodies = [n.body, n.otherwise or []]
    else:
        return False
    return any(_continues(c) for b in bodies for c in b)


def _no_continue(nodes: list[Node]) -> list[Node]:
    """A range body without `continue`: what follows a branch that continues moves into the
    branches that do not. (llama.cpp's Jinja engine drops the text an iteration wrote before
    its `{% continue %}`.)"""
    for i, n in enumerate(nodes):
        if isinstance(n, Control):
            return nodes[:i]
        if not _continues(n):
            continue
        rest = nodes[i + 1 :]
        if isinstance(n, If):
            branches = [(c, _no_continue(b + rest)) for c, b in n.branches]
            new: Node = If(branches, _no_continue((n.otherwise or []) + rest))
        else:
            assert isinstance(n, With)
            new = With(n.pipe, _no_continue(n.body + rest),
                       _no_continue((n.otherwise or []) + rest))  # fmt: skip
        return [*nodes[:i], new]
    return nodes


def _sub(sc: _Scope) -> _Scope:
    return _Scope(sc.dot, dict(sc.names))


def _is_map(expr: str) -> bool:
    """Maps in Ollama's template values: a tool's parameter properties (ranged as name,
    property in key order, as Go ranges over maps)."""
    return expr.endswith(".properties")


def _mentions(nodes: list[Node], name: str) -> bool:
    found = False

    def pipe(p: Pipe) -> None:
        nonlocal found
        for cmd in p.commands:
            for t in cmd:
                if t.kind in ("field", "root") and name in t.chain:
                    found = True
                elif t.kind == "paren" and isinstance(t.value, Pipe):
                    pipe(t.value)

    def walk(ns: list[Node]) -> None:
        for n in ns:
            if isinstance(n, Action):
                pipe(n.pipe)
            elif isinstance(n, If):
                for c, b in n.branches:
                    pipe(c)
                    walk(b)
                walk(n.otherwise or [])
            elif isinstance(n, (Range, With)):
                pipe(n.pipe)
                walk(n.body)
                walk(n.otherwise or [])

    walk(nodes)
    return found


def _cut_after_response(nodes: list[Node]) -> list[Node]:
    """The template up to its first `.Response` (inclusive), as Ollama renders the last round
    of a legacy template: the generation continues from there."""
    cut = False

    def walk(ns: list[Node]) -> list[Node]:
        nonlocal cut
        out: list[Node] = []
        for n in ns:
            if cut:
                break
            if isinstance(n, Action):
                out.append(n)
                cut = _mentions([n], "Response")
            elif isinstance(n, If):
                branches = []
                for c, b in n.branches:
                    branches.append((c, walk(b)))
                other = walk(n.otherwise) if n.otherwise is not None else None
                out.append(If(branches, other))
            elif isinstance(n, (Range, With)):
                body = walk(n.body)
                other = walk(n.otherwise) if n.otherwise is not None else None
                out.append(type(n)(n.pipe, body, other))
            else:
                out.append(n)
        return out

    return walk(nodes)


_PRELUDE = (
    "{%- macro _show(x) -%}{%- if x is string -%}{{ x }}{%- elif x is mapping or "
    "x is iterable -%}{{ x|tojson }}{%- else -%}{{ x }}{%- endif -%}"
    "{%- endmacro -%}"
    # .System: every system message, joined by blank lines (ollama collate)
    '{%- set _g = namespace(system="") -%}'
    '{%- for _m in messages -%}{%- if _m.role == "system" -%}'
    '{%- set _g.system = (_g.system ~ "\\n\\n" ~ _m.content) if _g.system else _m.content -%}'
    "{%- endif -%}{%- endfor -%}"
)


def to_jinja(text: str) -> str:
    """The Jinja chat template that renders what Ollama renders with Go template `text`."""
    nodes = parse(text)
    w = _Writer()
    root = _Scope("", {})
    if _mentions(nodes, "Messages"):
        body = w.nodes(nodes, root)
        head = '{%- set _response = "" -%}{%- set _prompt = "" -%}'
        return _PRELUDE + _vars(w) + head + body
    # Legacy: the template once per round (system?, user, assistant), the last round cut
    # after .Response; consecutive messages of one role joined as Ollama collates them.
    if not _mentions(nodes, "Response"):  # as Ollama parses it: the answer goes at the end
        nodes = [*nodes, Action(Pipe([[Term("field", None, ("Response",))]]))]
    whole = w.nodes(nodes, _Scope("", {}))
    last = w.nodes(_cut_after_response(nodes), _Scope("", {}))
    # Inside the macros .System is the round's own system message, not all of them.
    whole, last = (s.replace("_g.system", "_system") for s in (whole, last))
    return (
        _PRELUDE
        + "{%- macro _round(_system, _prompt, _response) -%}"
        + _vars(w)
        + whole
        + "{%- endmacro -%}"
        + "{%- macro _last(_system, _prompt, _response) -%}"
        + _vars(w)
        + last
        + "{%- endmacro -%}"
        + '{%- set _l = namespace(system="", prompt="", response="", role="", out="") -%}'
        + "{%- for _m in messages -%}"
        + '{%- set _c = _m.content if _m.content is string else "" -%}'
        + '{%- if _m.role == _l.role and _m.role != "tool" -%}'
        + '{%- if _m.role == "system" -%}{%- set _l.system = _l.system ~ "\\n\\n" ~ _c -%}'
        + '{%- elif _m.role == "user" -%}{%- set _l.prompt = _l.prompt ~ "\\n\\n" ~ _c -%}'
        + '{%- elif _m.role == "assistant" -%}'
        + '{%- set _l.response = _l.response ~ "\\n\\n" ~ _c -%}{%- endif -%}'
        + '{%- elif _m.role == "system" -%}'
        + "{%- if _l.prompt or _l.response -%}"
        + "{%- set _l.out = _l.out ~ _round(_l.system, _l.prompt, _l.response) -%}"
        + '{%- set _l.prompt = "" -%}{%- set _l.response = "" -%}{%- endif -%}'
        + "{%- set _l.system = _c -%}"
        + '{%- elif _m.role == "user" -%}'
        + "{%- if _l.response -%}"
        + "{%- set _l.out = _l.out ~ _round(_l.system, _l.prompt, _l.response) -%}"
        + '{%- set _l.system = "" -%}{%- set _l.response = "" -%}{%- endif -%}'
        + "{%- set _l.prompt = _c -%}"
        + '{%- elif _m.role == "assistant" -%}{%- set _l.response = _c -%}'
        + "{%- endif -%}"
        + "{%- set _l.role = _m.role -%}"
        + "{%- endfor -%}"
        + "{{ _l.out }}{{ _last(_l.system, _l.prompt, _l.response) }}"
    )


def _vars(w: _Writer) -> str:
    if not w.vars:
        return ""
    inits = ", ".join(f"{v}=none" for v in sorted(w.vars))
    return f"{{%- set _v = namespace({inits}) -%}}"


@functools.lru_cache(maxsize=64)
def _compiled(text: str) -> Any:
    import jinja2.sandbox

    # As llama.cpp renders chat templates (the translation does not depend on it: it writes
    # no raw text); sandboxed, since the template is the client's.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["strftime_now"] = lambda fmt: datetime.date.today().strftime(fmt)
    env.filters["tojson"] = lambda x: json.dumps(x, separators=(",", ":"), ensure_ascii=False)
    try:
        return env.from_string(text if is_jinja(text) else to_jinja(text))
    except jinja2.TemplateError as e:
        raise TemplateError(f"invalid template: {e}") from None


def render(template: str, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """The prompt `template` (Go, as Ollama's `template` request field, or Jinja) makes of
    `messages`, rendered here (a runner renders only its own template)."""
    import jinja2

    try:
        return str(_compiled(template).render(
            messages=messages, tools=tools or None, add_generation_prompt=True
        ))  # fmt: skip
    except jinja2.TemplateError as e:
        raise TemplateError(f"rendering the template failed: {e}") from None
