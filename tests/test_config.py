"""Settings, durations, sizes and hosts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.config import (
    ConfigError,
    Settings,
    host_variable,
    parse_duration,
    parse_host,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5m", 300),
        ("1h", 3600),
        ("1h30m", 5400),
        ("30s", 30),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("0", 0),
        (0, 0),
        (10, 10),
        (2.5, 2.5),
        ("120", 120),
        ("-1", math.inf),
        (-1, math.inf),
        ("-5m", math.inf),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["forever", "5 minutes", "m5", "", "5x", True, None, [], "nan"])
def test_bad_durations_name_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match="keep_alive"):
        parse_duration(bad, "keep_alive")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("500MB", 500 * 10**6),
        ("1024", 1024),
        ("1.5G", int(1.5 * 2**30)),
        ("10kb", 10_000),
        (4096, 4096),
    ],
)
def test_sizes(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["lots", "5 parsecs", "-1GiB", "", "GiB", -5])
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad, "CORRAL_MEMORY_LIMIT")


@given(st.integers(0, 10**7))
def test_seconds_roundtrip(n: int) -> None:
    assert parse_duration(f"{n}s") == n == parse_duration(str(n))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:11434", ("127.0.0.1", 11434)),
        (":8080", ("127.0.0.1", 8080)),
        ("0.0.0.0", ("0.0.0.0", 11434)),
        ("http://localhost:9000/", ("localhost", 9000)),
        ("[::1]:7000", ("::1", 7000)),
        ("21997", ("127.0.0.1", 21997)),  # a port alone
        ("http://0.0.0.0", ("0.0.0.0", 80)),  # a URL's scheme sets the default port
        ("https://example.com/x", ("example.com", 443)),
        ("'localhost:9'", ("localhost", 9)),  # quotes around it, as Ollama strips them
    ],
)
def test_hosts(text: str, expected: tuple[str, int]) -> None:
    assert parse_host(text) == expected


def test_settings_defaults_env_and_overrides() -> None:
    s = Settings.load(environ={})
    assert (s.host, s.port) == ("127.0.0.1", 11434)
    assert s.keep_alive == 300 and s.context_length is None and s.max_queue == 512  # auto
    assert s.memory_margin == 2**30 and s.memory_limit is None and s.max_loaded_models == 0
    env = {"CORRAL_KEEP_ALIVE": "-1", "CORRAL_MEMORY_LIMIT": "2GiB", "CORRAL_NUM_PARALLEL": "4"}
    s = Settings.load({"CORRAL_NUM_PARALLEL": "2"}, environ=env)
    assert s.keep_alive == math.inf and s.memory_limit == 2 * 2**30 and s.num_parallel == 2


def test_ollama_host_is_read_when_corral_host_is_unset() -> None:
    s = Settings.load(environ={"OLLAMA_HOST": "0.0.0.0:21997"})
    assert (s.host, s.port) == ("0.0.0.0", 21997)
    s = Settings.load(environ={"OLLAMA_HOST": "0.0.0.0:21997", "CORRAL_HOST": "21998"})
    assert (s.host, s.port) == ("127.0.0.1", 21998)
    s = Settings.load({"CORRAL_HOST": ":7"}, environ={"OLLAMA_HOST": "0.0.0.0:21997"})
    assert (s.host, s.port) == ("127.0.0.1", 7)  # `corral serve --host` first
    with pytest.raises(ConfigError, match="OLLAMA_HOST: invalid port"):
        Settings.load(environ={"OLLAMA_HOST": "localhost:x"})
    assert host_variable({"CORRAL_HOST": " ", "OLLAMA_HOST": "h"}) == ("OLLAMA_HOST", "h")
    assert host_variable({}) == ("CORRAL_HOST", "")


def test_the_context_length_is_auto_or_a_number() -> None:
    for text, value in (("auto", None), ("AUTO", None), ("8192", 8192), ("0", 0)):
        assert Settings.load(environ={"CORRAL_CONTEXT_LENGTH": text}).context_length == value
    with pytest.raises(ConfigError, match="CORRAL_CONTEXT_LENGTH: expected 'auto' or a number"):
        Settings.load(environ={"CORRAL_CONTEXT_LENGTH": "-5"})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CORRAL_NUM_PARALLEL": "0"}, "CORRAL_NUM_PARALLEL"),
        ({"CORRAL_CONTEXT_LENGTH": "big"}, "CORRAL_CONTEXT_LENGTH"),
        ({"CORRAL_HOST": "localhost:99999"}, "CORRAL_HOST"),
        ({"CORRAL_MEMORY_MARGIN": "x"}, "CORRAL_MEMORY_MARGIN"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.load(environ=env)


def test_the_readme_lists_every_setting_as_the_table_has_it() -> None:
    """README's settings table, row by row, against config.SETTINGS: the same variables, each
    with its `corral serve` flag and its default ("unset" for an empty one)."""
    import re
    from pathlib import Path

    from corral.config import SETTINGS

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("### Settings", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `(CORRAL_\w+)` \| (`(--[\w-]+)`)? ?\| (.+?) \|", line)
        if m:
            rows[m.group(1)] = (m.group(3), m.group(4))
    expected = {
        s.variable: (s.flag, f"`{s.default}`" if s.default else "unset") for s in SETTINGS
    }
    assert rows == expected
