"""Did-you-mean for a mistyped command or model name (pure; difflib's closeness)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_words(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The choices closest to `word`, best first (difflib's ratio of at least 0.6)."""
    return difflib.get_close_matches(word, list(dict.fromkeys(choices)), n=n, cutoff=0.6)


def _forms(name: str) -> list[str]:
    """What a name may be typed as: whole, without its tag, its last path part (`run-gguf` of
    `hf.co/owner/run-gguf:q4_k_m`)."""
    stem = name.lower().split(":")[0]
    return list(dict.fromkeys([name.lower(), stem, stem.rsplit("/", 1)[-1]]))


def close_models(name: str, names: Iterable[str], n: int = 3) -> list[str]:
    """Model names close to `name`: those a tag or a suffix away first (`smollm2` ->
    `smollm2:135m`, `llama` -> `llama3.2:1b`, `run-gguf` -> `hf.co/owner/run-gguf:latest`),
    then difflib's nearest to any form of a name (`smolm2` -> `smollm2:135m`)."""
    listed = list(dict.fromkeys(names))
    want = name.strip().lower()
    if not want:
        return []
    base = want.removesuffix(":latest")
    out = [m for m in listed if base in _forms(m)[1:]]
    out += [m for m in listed if any(f.startswith(base) for f in _forms(m)) and m not in out]
    # Each form of each name is compared, so a long tag or path does not hide a close name.
    forms: dict[str, str] = {}
    for m in listed:
        for f in _forms(m):
            forms.setdefault(f, m)
    for match in difflib.get_close_matches(base, list(forms), n=3 * n, cutoff=0.6):
        if forms[match] not in out:
            out.append(forms[match])
    return [m for m in out if m.lower() != want][:n]


def did_you_mean(choices: list[str]) -> str:
    """Cobra's suggestion block, as `ollama` prints it under an unknown command."""
    if not choices:
        return ""
    return "\nDid you mean this?\n" + "".join(f"\t{c}\n" for c in choices)
