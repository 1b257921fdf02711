"""Model files' paths as a client may see them: absolute only for a caller holding the API key
(the guard marks its scope, `AUTHORIZED`), else relative to the models directory, or just the
file's name when it lives elsewhere; never the layout of the machine."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.types import Scope

AUTHORIZED = "corral.authorized"  # scope key: the request carried one of the API keys


def shown_path(scope: Scope | Request, path: str | Path, models_dir: Path) -> str:
    """A model file's path for the client: absolute only for a caller holding the API key,
    else relative to the models directory (or just the file's name when it lives elsewhere)."""
    s = scope.scope if isinstance(scope, Request) else scope
    if s.get(AUTHORIZED):
        return str(path)
    p = Path(path)
    for base in (models_dir, models_dir.resolve()):
        try:
            return str(p.relative_to(base))
        except ValueError:
            continue
    return p.name


def hide_paths(
    scope: Scope | Request, text: str, paths: Iterable[str | Path], models_dir: Path
) -> str:
    """`text` with each of `paths` as `shown_path` gives it (longest first)."""
    for p in sorted({str(p) for p in paths if p}, key=len, reverse=True):
        text = text.replace(p, shown_path(scope, p, models_dir))
    return text


def entry_paths(entry: Any) -> list[Path]:
    """The files a registry entry names: its model, projector and adapters."""
    adapters = [getattr(a, "path", a) for a in getattr(entry, "adapters", ())]
    return [p for p in (entry.path, getattr(entry, "projector", None), *adapters) if p]
