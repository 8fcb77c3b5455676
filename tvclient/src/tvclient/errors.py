"""Errors raised by the tvcache clients."""

from __future__ import annotations

from typing import Any


class TVCacheError(Exception):
    """The service answered with an error (`{"error": {"code", "message", "details"}}`).

    `status` is the HTTP status, or None when no answer came back at all.
    """

    def __init__(self, status: int | None, code: str, message: str, details: Any = None) -> None:
        where = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{code}: {message} ({where})")
        self.status = status
        self.code = code
        self.message = message
        self.details = details


class TVCacheUnavailable(TVCacheError):
    """The service could not be reached, timed out, failed (5xx) or shed load (429).

    A separate class because a trainer may retry, or run the call without the cache, on this
    error but never on a rejected request. `retry_after_s`: what the answer's Retry-After said.
    """

    def __init__(
        self, status: int | None, code: str, message: str, details: Any = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(status, code, message, details)
        self.retry_after_s = retry_after_s
