"""The CLI's HTTP client of a running server: addresses, errors, NDJSON streams."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import httpx

from corral.config import host_variable, parse_address

JSON = dict[str, Any]


class CLIError(Exception):
    """A failure reported as `Error: <message>` with exit status 1, never as a traceback;
    `status` is the HTTP status of a server's error answer, when it was one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Unreachable(CLIError):
    def __init__(self, url: str) -> None:
        super().__init__(
            f"could not connect to corral server at {url}; is it running? "
            "(start it with: corral serve)"
        )


def base_url(host: str, name: str = "CORRAL_HOST") -> str:
    """The client's URL for an address setting, read as Ollama reads OLLAMA_HOST (see
    corral.config.parse_address): bare values mean http on port 11434, a port alone means
    127.0.0.1, a URL's scheme sets its default port, and a path after the address is kept
    (for servers behind a prefix). ValueError (a ConfigError) for a bad one."""
    return parse_address(host, name).url()


def error_message(status: int, reason: str, body: str) -> str:
    """The message of an HTTP error answer: its JSON "error", else its text, else the status."""
    with contextlib.suppress(ValueError):
        data = json.loads(body)
        if isinstance(data, dict) and data.get("error"):
            return str(data["error"])
    text = body.strip()
    return text[:500] if text else f"{status} {reason}".strip()


class Client:
    """Synchronous client for the Ollama API that turns transport and API failures into CLIError."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url
        # Loads and generations can take minutes, so only connecting is time-limited. Proxy
        # variables are ignored: the server is almost always local.
        self._http = httpx.Client(
            base_url=url,
            timeout=httpx.Timeout(None, connect=10.0),
            trust_env=False,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise Unreachable(self.url) from None
        except httpx.TimeoutException:
            raise CLIError(f"timed out talking to corral server at {self.url}") from None
        except httpx.TransportError as e:
            raise CLIError(f"lost connection to corral server at {self.url}: {e}") from None
        except httpx.HTTPError as e:
            raise CLIError(str(e)) from None

    def get(self, path: str) -> JSON:
        with self._errors():
            resp = self._http.get(path)
        return _decode(_checked(resp).text)

    def post(self, path: str, body: Mapping[str, Any]) -> JSON:
        with self._errors():
            resp = self._http.post(path, json=body)
        return _decode(_checked(resp).text)

    def send(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        content: Any = None,
        ok: tuple[int, ...] = (),
    ) -> httpx.Response:
        """Any request, its answer as it is (an empty body is fine); an error status other
        than those in `ok` raises CLIError."""
        with self._errors():
            resp = self._http.request(method, path, json=body, content=content)
        return resp if resp.status_code in ok else _checked(resp)

    def stream(self, path: str, body: Mapping[str, Any]) -> Generator[JSON, None, None]:
        """POST and yield NDJSON objects as they arrive; an {"error"} line raises CLIError."""
        with self._errors(), self._http.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                _checked(resp)
            # A plain JSON answer (e.g. to a load request) is a one-line stream.
            for line in resp.iter_lines():
                if not line.strip():
                    continue
                chunk = _decode(line)
                if "error" in chunk:
                    raise CLIError(str(chunk["error"]))
                yield chunk


def _checked(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        raise CLIError(
            error_message(resp.status_code, resp.reason_phrase, resp.text), resp.status_code
        )
    return resp


def _decode(text: str) -> JSON:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise CLIError(f"unexpected response from server: {text[:200]!r}")
    if "error" in data and len(data) == 1:
        raise CLIError(str(data["error"]))
    return data


def api_key(value: str | None = None) -> str | None:
    """The key the CLI sends: the first of CORRAL_API_KEY's comma-separated keys."""
    text = os.environ.get("CORRAL_API_KEY", "") if value is None else value
    keys = [k.strip() for k in text.strip().strip("\"'").split(",") if k.strip()]
    return keys[0] if keys else None


def connect() -> Client:
    """A client of the server at CORRAL_HOST, else OLLAMA_HOST, else 127.0.0.1:11434."""
    variable, host = host_variable()
    try:
        return Client(base_url(host, variable), api_key())
    except ValueError as e:
        raise CLIError(str(e)) from None
