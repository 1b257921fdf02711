"""The operator keeps control of keep-alive: CORRAL_KEEP_ALIVE_MAX caps what a request asks,
models.toml gives a model its own, and `keep_alive_fixed` stops clients changing it."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from corral.testing.server import CorralServer


@pytest.fixture(scope="module")
def ka_server(start_server, models_dir: Path, tmp_path_factory) -> CorralServer:
    d = tmp_path_factory.mktemp("ka_models")
    for name in ("tiny", "tiny2", "long"):
        shutil.copy(models_dir / f"{name}.gguf", d / f"{name}.gguf")
    (d / "models.toml").write_text(
        '[models.fixed]\nfile = "tiny2.gguf"\nkeep_alive = "30s"\nkeep_alive_fixed = true\n'
        '[models.own]\nfile = "long.gguf"\nkeep_alive = "2m"\n'
    )
    return start_server(d, CORRAL_BUILTIN_MODELS="0", CORRAL_KEEP_ALIVE_MAX="10m")


def load(s: CorralServer, model: str, keep_alive: object = None) -> float:
    body: dict[str, object] = {"model": model}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    r = s.client.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    # (the runner serving it: "own" shares one with long.gguf's own name)
    (m,) = [m for m in s.ps() if f"{model}:latest" in m["models"]]
    return float(m["keep_alive"])


def test_a_request_cannot_keep_a_model_longer_than_the_cap(ka_server: CorralServer) -> None:
    assert load(ka_server, "tiny", -1) == 600  # "forever" capped at 10m
    assert load(ka_server, "tiny", "1h") == 600
    assert load(ka_server, "tiny", "90s") == 90  # below the cap: as asked


def test_a_model_keeps_its_own_keep_alive_unless_the_client_asks(
    ka_server: CorralServer,
) -> None:
    assert load(ka_server, "own") == 120
    assert load(ka_server, "own", "45s") == 45


def test_a_fixed_keep_alive_ignores_the_client(ka_server: CorralServer) -> None:
    assert load(ka_server, "fixed", -1) == 30
    assert load(ka_server, "fixed", "5m") == 30
    r = ka_server.client.post(
        "/api/generate", json={"model": "fixed", "prompt": "hi", "stream": False,
                               "keep_alive": "1h", "options": {"num_predict": 1}},
    )  # fmt: skip
    assert r.status_code == 200
    (m,) = [m for m in ka_server.ps() if "fixed:latest" in m["models"]]
    assert m["keep_alive"] == 30


def test_an_explicit_unload_still_unloads_a_fixed_model(ka_server: CorralServer) -> None:
    load(ka_server, "fixed")
    r = ka_server.client.post("/api/generate", json={"model": "fixed", "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    ka_server.wait_for(
        lambda: not [m for m in ka_server.ps() if "fixed:latest" in m["models"]],
        timeout=15, what="fixed unloaded",
    )  # fmt: skip


def test_the_cap_must_be_a_duration(tmp_path: Path) -> None:
    from corral.config import ConfigError, Settings

    with pytest.raises(ConfigError, match="CORRAL_KEEP_ALIVE_MAX"):
        Settings.load({"CORRAL_KEEP_ALIVE_MAX": "soon"})
    s = Settings.load({"CORRAL_KEEP_ALIVE_MAX": "1m", "CORRAL_KEEP_ALIVE": "5m"})
    assert s.keep_alive == 60 and s.keep_alive_max == 60  # the default obeys the cap too
    assert httpx  # the client module is what the fixtures use
