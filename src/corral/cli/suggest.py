"""Did-you-mean for a mistyped command or model name (pure; difflib's closeness)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_words(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The choices closest to `word`, best first (difflib's ratio of at least 0.6)."""
    return difflib.get_close_matches(word, list(dict.fromkeys(choices)), n=n, cutoff=0.6)


def close_models(name: str, names: Iterable[str], n: int = 3) -> list[str]:
    """Model names close to `name`: those a tag or prefix away first (`smollm2` ->
    `smollm2:135m`, `llama` -> `llama3.2:1b`), then difflib's nearest to the whole name or to
    its part before the tag (`smolm2` -> `smollm2:135m`)."""
    listed = list(dict.fromkeys(names))
    want = name.strip().lower()
    if not want:
        return []
    base = want.removesuffix(":latest")
    out = [m for m in listed if m.lower().split(":")[0] == base]
    out += [m for m in listed if m.lower().startswith(base) and m not in out]
    # Each name's part before the tag is compared too, so a short name's tag does not hide it.
    stems: dict[str, str] = {}
    for m in listed:
        stems.setdefault(m.lower().split(":")[0], m)
        stems.setdefault(m.lower(), m)
    for match in difflib.get_close_matches(base, list(stems), n=2 * n, cutoff=0.6):
        if stems[match] not in out:
            out.append(stems[match])
    return [m for m in out if m.lower() != want][:n]


def did_you_mean(choices: list[str]) -> str:
    """Cobra's suggestion block, as `ollama` prints it under an unknown command."""
    if not choices:
        return ""
    return "\nDid you mean this?\n" + "".join(f"\t{c}\n" for c in choices)
