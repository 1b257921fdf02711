"""The error a client hears, with its HTTP status: raised from the runner client up and answered
by each API family in its own shape (never a traceback). Below api/, so that runtime/ raises it
too (runtime.hop: a runner's failure or refusal as the client's)."""

from __future__ import annotations


class ApiError(Exception):
    """An error the client caused or must hear about; never a traceback."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds: sent as Retry-After (503 when busy)
        self.code = code  # a machine-readable code where the API has one (OpenAI's `code`)
