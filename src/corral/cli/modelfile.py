"""Ollama's Modelfile, read into the JSON form of /api/create (what `ollama create` sends).

    FROM <model name | path to a GGUF file>     (a second FROM may name the mmproj file)
    PARAMETER <name> <value>                    (repeated `stop` lines make a list; `draft`
                                                 a model name or a GGUF path, made absolute)
    TEMPLATE / SYSTEM / LICENSE <text>          (text in triple quotes may span lines)
    ADAPTER <path to a LoRA adapter GGUF>
    MESSAGE <role> <content>

Files are not read here: `parse` returns the request with the paths to upload beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMANDS = ("from", "parameter", "template", "system", "adapter", "license", "message",
            "requires")  # fmt: skip


class ModelfileError(ValueError):
    pass


@dataclass
class Parsed:
    """The /api/create body, less the digests of `files` and `adapters` (paths to upload)."""

    body: dict[str, Any] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    adapters: list[Path] = field(default_factory=list)


def commands(text: str) -> list[tuple[str, str]]:
    """(command, argument) pairs; triple-quoted arguments may span lines."""
    out: list[tuple[str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        cmd = word.lower()
        if cmd not in COMMANDS:
            raise ModelfileError(f"line {i}: unknown command '{word}'")
        rest = rest.strip()
        if cmd in ("parameter", "message"):  # a name or role first, then the value
            key, _, value = rest.partition(" ")
            value = value.strip()
            if value.startswith('"""'):
                value, i = _triple(value, lines, i)
            out.append((cmd, f"{key} {_unquote(value)}" if cmd == "message" else
                        f"{key} {value}"))  # fmt: skip
            continue
        if rest.startswith('"""'):
            rest, i = _triple(rest, lines, i)
        out.append((cmd, _unquote(rest)))
    return out


def _triple(first: str, lines: list[str], i: int) -> tuple[str, int]:
    """Text between triple quotes that start `first` (lines[i:] follow it)."""
    body = first[3:]
    if '"""' in body:
        return body[: body.index('"""')], i
    parts = [body]
    while i < len(lines):
        line = lines[i]
        i += 1
        if '"""' in line:
            parts.append(line[: line.index('"""')])
            return "\n".join(parts).strip("\n"), i
        parts.append(line)
    raise ModelfileError('unterminated """ text')


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def typed(value: str) -> Any:
    """A PARAMETER value as JSON: a number or boolean where it reads as one, else text."""
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return _unquote(value)


def parse(text: str, base: Path) -> Parsed:
    """A Modelfile (paths relative to `base`, its folder) as a create request."""
    out = Parsed()
    params: dict[str, Any] = {}
    licenses: list[str] = []
    messages: list[dict[str, str]] = []
    for cmd, arg in commands(text):
        if cmd == "from":
            path = Path(os.path.expanduser(arg))
            path = path if path.is_absolute() else base / path
            if path.is_dir():
                raise ModelfileError(
                    f"FROM {arg}: a folder (safetensors) cannot be imported: corral creates "
                    "models from GGUF files"
                )
            if path.is_file():
                out.files.append(path)
            elif arg.startswith((".", "/", "~")) or arg.lower().endswith(".gguf"):
                raise ModelfileError(f"FROM {arg}: no such file")
            elif "from" in out.body:
                raise ModelfileError("more than one model name in FROM lines")
            else:
                out.body["from"] = arg
        elif cmd == "adapter":
            path = Path(os.path.expanduser(arg))
            path = path if path.is_absolute() else base / path
            if not path.is_file():
                raise ModelfileError(f"ADAPTER {arg}: no such file")
            out.adapters.append(path)
        elif cmd == "parameter":
            name, _, value = arg.partition(" ")
            if not value:
                raise ModelfileError(f"PARAMETER {name}: missing value")
            if name == "stop":
                params.setdefault("stop", []).append(_unquote(value))
            elif name == "draft":  # a model name, or a GGUF file (on the server's machine)
                value = _unquote(value)
                path = Path(os.path.expanduser(value))
                path = path if path.is_absolute() else base / path
                params[name] = str(path.resolve()) if path.is_file() else value
            else:
                params[name] = typed(value)
        elif cmd in ("template", "system"):
            out.body[cmd] = arg
        elif cmd == "license":
            licenses.append(arg)
        elif cmd == "message":
            role, _, content = arg.partition(" ")
            messages.append({"role": role, "content": content})
    if "from" in out.body and out.files:
        raise ModelfileError("FROM names both a model and a file")
    if "from" not in out.body and not out.files:
        raise ModelfileError("no FROM line")
    if params:
        out.body["parameters"] = params
    if licenses:
        out.body["license"] = licenses if len(licenses) > 1 else licenses[0]
    if messages:
        out.body["messages"] = messages
    return out
