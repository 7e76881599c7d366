"""Typed errors. Every reply on NATS is a result or `{code, message, retryable}` — never a bare exception string."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """An error a handler means to return to its caller."""

    code: str = "internal"
    retryable: bool = False

    def __init__(self, message: str, *, code: str | None = None, retryable: bool | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        self.details = details

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.details:
            out["details"] = self.details
        return out


class InvalidPayload(ServiceError):
    """The payload does not match the subject's contract."""

    code = "invalid-payload"


class NotFound(ServiceError):
    code = "not-found"


class Conflict(ServiceError):
    """Optimistic concurrency: the expected version is not the current one."""

    code = "version-conflict"


class DependencyUnavailable(ServiceError):
    """A backing store (S3, Postgres, a downstream service) is down or timed out; try again later."""

    code = "unavailable"
    retryable = True


class RemoteError(ServiceError):
    """Raised on the caller's side when a reply carries an error."""

    def __init__(self, subject: str, code: str, message: str, retryable: bool,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{subject}: [{code}] {message}", code=code, retryable=retryable, details=details)
        self.subject = subject
        self.remote_message = message


class ClaimMissing(ServiceError):
    """A claim-checked payload is gone from the claim store (expired, or already consumed). Retryable: sending
    the request again stores a fresh claim."""

    code = "claim-missing"
    retryable = True


class ClaimCorrupt(ServiceError):
    """A claim-checked payload read back with another size or sha256 than its claim names."""

    code = "claim-corrupt"
    retryable = True


class PayloadTooLarge(ServiceError):
    """A message that exceeds the transport's limit even in its claim form (e.g. oversized headers)."""

    code = "payload-too-large"
