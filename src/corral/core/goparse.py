"""Ollama's Go chat templates parsed into nodes, for `core/gotemplate.py` to translate.

The subset Ollama's templates use: text, `{{ pipeline }}`, `if`/`else if`/`else`, `range`,
`with`, variable declarations and assignments, `continue` and comments; Go's `{{-`/`-}}`
trimming is applied to the text around an action while parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "Action",
    "Control",
    "If",
    "Node",
    "Pipe",
    "Range",
    "TemplateError",
    "Term",
    "Text",
    "With",
    "parse",
]


class TemplateError(ValueError):
    """The template cannot be translated (a construct or function corral does not know)."""


@dataclass
class Text:
    text: str


@dataclass
class Action:  # {{ pipeline }}: printed unless it assigns
    pipe: Pipe


@dataclass
class If:
    branches: list[tuple[Pipe, list[Node]]]
    otherwise: list[Node] | None = None


@dataclass
class Range:
    pipe: Pipe  # with its declared variables, if any
    body: list[Node]
    otherwise: list[Node] | None = None


@dataclass
class With:
    pipe: Pipe
    body: list[Node]
    otherwise: list[Node] | None = None


@dataclass
class Control:
    word: str  # continue


Node = Text | Action | If | Range | With | Control


@dataclass
class Term:
    kind: str  # field (from dot) | var | root | str | num | bool | nil | func | paren | dot
    value: object = None
    chain: tuple[str, ...] = ()


@dataclass
class Pipe:
    commands: list[list[Term]]
    decl: list[str] = field(default_factory=list)  # variable names (without $)
    assign: str = ""  # ":=" or "=" or "" (print)


_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(
    r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*") | (?P<raw>`[^`]*`) |
    (?P<num>-?\d+(?:\.\d+)?) | (?P<op>:=|=|\||\(|\)|,) |
    (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_]\w*)*) |
    (?P<chain>(?<=\))(?:\.[A-Za-z_]\w*)+) |
    (?P<field>(?:\.[A-Za-z_]\w*)+|\.) |
    (?P<ident>[A-Za-z_]\w*)
    )""",
    re.X | re.S,
)
_GO_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}


def _tokens(src: str) -> list[tuple[str, str]]:
    out, pos, src = [], 0, src.strip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None or m.end() == pos:
            raise TemplateError(f"cannot read {src[pos : pos + 20]!r} in {{{{ {src} }}}}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(src) and src[pos].isspace():
            pos += 1
    return out


def _string(tok: str) -> str:
    if tok.startswith("`"):
        return tok[1:-1]

    def esc(m: re.Match[str]) -> str:
        c = m.group(1)
        if c in _GO_ESCAPES:
            return _GO_ESCAPES[c]
        if c.startswith(("u", "x")):
            return chr(int(c[1:], 16))
        raise TemplateError(f"unknown escape \\{c} in {tok}")

    return re.sub(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)", esc, tok[1:-1])


def _pipe(toks: list[tuple[str, str]]) -> Pipe:
    pipe = Pipe([])
    # `$a, $b := ...` or `$a := ...` / `$a = ...`
    i = 0
    names = []
    while i < len(toks) and toks[i][0] == "var" and "." not in toks[i][1]:
        names.append(toks[i][1][1:])
        if i + 1 < len(toks) and toks[i + 1] == ("op", ","):
            i += 2
            continue
        break
    if names and i + 1 < len(toks) and toks[i + 1][0] == "op" and toks[i + 1][1] in (":=", "="):
        pipe.decl, pipe.assign = names, toks[i + 1][1]
        toks = toks[i + 2 :]
    pos = 0

    def term() -> Term:
        nonlocal pos
        kind, tok = toks[pos]
        pos += 1
        t: Term
        if kind == "op" and tok == "(":
            inner = []
            depth = 1
            while pos < len(toks):
                if toks[pos] == ("op", "("):
                    depth += 1
                elif toks[pos] == ("op", ")"):
                    depth -= 1
                    if depth == 0:
                        break
                inner.append(toks[pos])
                pos += 1
            else:
                raise TemplateError("unclosed parenthesis")
            pos += 1
            t = Term("paren", _pipe(inner))
            if pos < len(toks) and toks[pos][0] == "chain":
                t.chain = tuple(toks[pos][1].split(".")[1:])
                pos += 1
            return t
        if kind in ("str", "raw"):
            return Term("str", _string(tok))
        if kind == "num":
            return Term("num", float(tok) if "." in tok else int(tok))
        if kind == "var":
            name, *chain = tok[1:].split(".")
            return Term("root" if name == "" else "var", name, tuple(chain))
        if kind == "field":
            return Term("dot") if tok == "." else Term("field", None, tuple(tok.split(".")[1:]))
        if kind == "ident":
            if tok in ("true", "false"):
                return Term("bool", tok == "true")
            if tok == "nil":
                return Term("nil")
            return Term("func", tok)
        raise TemplateError(f"unexpected {tok!r}")

    command: list[Term] = []
    while pos < len(toks):
        if toks[pos] == ("op", "|"):
            if not command:
                raise TemplateError("empty command before '|'")
            pipe.commands.append(command)
            command = []
            pos += 1
            continue
        command.append(term())
    if not command:
        raise TemplateError("empty pipeline")
    pipe.commands.append(command)
    return pipe


def parse(text: str) -> list[Node]:
    """Go template text -> nodes (trim markers applied to the text around them)."""
    pieces: list[tuple[str, str]] = []  # ("text", s) | ("action", body)
    pos = 0
    for m in _ACTION.finditer(text):
        before = text[pos : m.start()]
        if m.group(1):
            before = before.rstrip()
        pieces.append(("text", before))
        pieces.append(("action", m.group(2)))
        pos = m.end()
        if m.group(3):
            rest = text[pos:]
            pos += len(rest) - len(rest.lstrip())
    pieces.append(("text", text[pos:]))
    stack: list[tuple[If | Range | With | None, list[Node]]] = [(None, [])]

    def body() -> list[Node]:
        return stack[-1][1]

    for kind, s in pieces:
        if kind == "text":
            if s:
                body().append(Text(s))
            continue
        s = s.strip()
        if s.startswith("/*"):
            if not s.endswith("*/"):
                raise TemplateError("unclosed comment")
            continue
        word, _, rest = s.partition(" ")
        if word == "if":
            cond = If([(_pipe(_tokens(rest)), [])])
            body().append(cond)
            stack.append((cond, cond.branches[0][1]))
        elif word in ("range", "with"):
            block = (Range if word == "range" else With)(_pipe(_tokens(rest)), [])
            body().append(block)
            stack.append((block, block.body))
        elif word == "else":
            owner = stack[-1][0]
            if owner is None:
                raise TemplateError("{{ else }} outside if, range or with")
            stack.pop()
            rest = rest.strip()
            if rest.startswith("if ") and isinstance(owner, If):
                owner.branches.append((_pipe(_tokens(rest[3:])), []))
                stack.append((owner, owner.branches[-1][1]))
            elif rest:
                raise TemplateError(f"{{{{ else {rest} }}}} is not supported")
            else:
                owner.otherwise = []
                stack.append((owner, owner.otherwise))
        elif word == "end":
            if len(stack) == 1:
                raise TemplateError("{{ end }} without a block")
            stack.pop()
        elif word == "continue":
            if not any(isinstance(owner, Range) for owner, _ in stack):
                raise TemplateError("{{ continue }} outside range")
            body().append(Control(word))
        elif word in ("template", "define", "block", "break"):
            raise TemplateError(f"{{{{ {word} }}}} is not supported")
        else:
            body().append(Action(_pipe(_tokens(s))))
    if len(stack) != 1:
        raise TemplateError("a block is not closed with {{ end }}")
    return stack[0][1]
