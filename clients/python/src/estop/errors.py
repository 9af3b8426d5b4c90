"""Exceptions: gate errors by stable code, refusals carrying their reason, connection trouble."""

from __future__ import annotations

from typing import Any

__all__ = [
    "EstopError",
    "ConnectionLost",
    "EstopTimeout",
    "GateError",
    "InvalidRequest",
    "LineTooLong",
    "Unauthenticated",
    "Forbidden",
    "NotFound",
    "NotPending",
    "BadToken",
    "Conflict",
    "LimitExceeded",
    "Unavailable",
    "Refused",
    "RunStopped",
    "Interrupted",
    "Rejected",
    "Denied",
    "Mismatch",
    "HeldForApproval",
    "InDoubt",
    "EffectFailed",
    "NoRun",
    "error_from_reply",
    "refusal",
]


class EstopError(Exception):
    """Base class of everything this package raises."""


class ConnectionLost(EstopError):
    """The gate could not be reached (after the configured reconnect attempts) or hung up."""


class EstopTimeout(EstopError, TimeoutError):
    """No reply within the client's timeout. The request may or may not have been applied;
    every gate call this package makes is safe to repeat with the same key."""


class GateError(EstopError):
    """The gate answered `ok: false`. `code` is one of docs/PROTOCOL.md's stable error codes."""

    code: str = ""

    def __init__(self, code: str, message: str, reply: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reply = reply or {}


class InvalidRequest(GateError):
    """bad_json, unknown_op, missing_field, invalid_field, line_too_long, args_required."""


class LineTooLong(InvalidRequest):
    """The request's line is longer than the gate's `line_bytes_max`: refused by the client before
    it was sent, or by the gate (which answers such a line with `id: null`, since it never read
    it; the client fails the request in flight that caused it with this error)."""


class Unauthenticated(GateError):
    pass


class Forbidden(GateError):
    pass


class NotFound(GateError):
    pass


class NotPending(GateError):
    pass


class BadToken(GateError):
    pass


class Conflict(GateError):
    pass


class LimitExceeded(GateError):
    pass


class Unavailable(GateError):
    """The gate could not make the change durable; retry later with the same key."""


_BY_CODE: dict[str, type[GateError]] = {
    "bad_json": InvalidRequest,
    "unknown_op": InvalidRequest,
    "missing_field": InvalidRequest,
    "invalid_field": InvalidRequest,
    "line_too_long": LineTooLong,
    "args_required": InvalidRequest,
    "policy_args_required": InvalidRequest,
    "unauthenticated": Unauthenticated,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "not_pending": NotPending,
    "bad_token": BadToken,
    "conflict": Conflict,
    "limit_exceeded": LimitExceeded,
    "unavailable": Unavailable,
}


def error_from_reply(reply: dict[str, Any]) -> GateError:
    err = reply.get("error") or {}
    code = str(err.get("code", "internal"))
    return _BY_CODE.get(code, GateError)(code, str(err.get("message", "")), reply)


class Refused(EstopError):
    """The gate refused the effect; it must not run. `reason` is the gate's refusal reason:
    cancelled, rejected, expired, denied, budget, deadline, mismatch, closed."""

    def __init__(
        self,
        reason: str,
        *,
        run: str | None = None,
        key: str | None = None,
        tool: str | None = None,
        message: str | None = None,
        rule: str | None = None,
        local: bool = False,
    ) -> None:
        text = f"estop refused {tool or 'effect'}"
        if run:
            text += f" in run {run!r}"
        text += f": {reason}"
        if message:
            text += f" ({message})"
        if local:
            text += " [local fence]"
        super().__init__(text)
        self.reason = reason
        self.run = run
        self.key = key
        self.tool = tool
        self.message = message
        self.rule = rule
        self.local = local


class RunStopped(Refused):
    """The run (or an ancestor) was stopped: cancelled, killed, closed, past its deadline or budget."""


class Interrupted(Refused):
    """This invocation of the agent was interrupted locally (a stream closed early, a step
    timeout, Ctrl-C, a task cancel, a client-side timeout): its leftover threads and tasks start
    nothing more. Not a stop of the run: the gate was not told, and the next invocation of the
    same run goes on (seed 004: interrupt is not cancel). Always local."""

    def __init__(self, reason: str = "interrupted", **kw: Any) -> None:
        kw.setdefault("local", True)
        super().__init__("interrupted", message=reason, **kw)


class Rejected(Refused):
    """An operator rejected the effect (or the same call earlier in the run), or its approval expired."""


class Denied(Refused):
    """Policy denies the tool (or a policy condition failed to evaluate; `rule` names it)."""


class Mismatch(Refused):
    """The key was used before with different arguments."""


_REFUSAL_CLASS: dict[str, type[Refused]] = {
    "cancelled": RunStopped,
    "closed": RunStopped,
    "deadline": RunStopped,
    "budget": RunStopped,
    "rejected": Rejected,
    "expired": Rejected,
    "denied": Denied,
    "mismatch": Mismatch,
}


def refusal(reason: str, **kw: Any) -> Refused:
    """The most specific Refused subclass for a refusal reason."""
    return _REFUSAL_CLASS.get(reason, Refused)(reason, **kw)


class HeldForApproval(EstopError):
    """Raised instead of waiting when an effect is held and the caller asked not to block
    (adapters turn it into the framework's own interrupt). Re-running the same call later with
    the same run and step re-asks the gate with the same key."""

    def __init__(self, run: str, key: str, tool: str, held: Any) -> None:
        super().__init__(f"{tool} in run {run!r} is held ({held.reason}); key {key!r}")
        self.run = run
        self.key = key
        self.tool = tool
        self.held = held

    @property
    def reason(self) -> str:
        return str(self.held.reason)


class InDoubt(EstopError):
    """The effect was started before (status started/unknown) and has no recorded result; running
    it again could do it twice, so this call does not run it."""

    def __init__(self, run: str, key: str, status: str) -> None:
        super().__init__(f"effect {key!r} of run {run!r} is {status}: not run again")
        self.run = run
        self.key = key
        self.status = status


class EffectFailed(EstopError):
    """A duplicate of an effect whose recorded outcome is `error`: the recorded error, re-raised."""

    def __init__(self, run: str, key: str, error: str | None) -> None:
        super().__init__(f"effect {key!r} of run {run!r} failed before: {error}")
        self.run = run
        self.key = key
        self.error = error


class NoRun(EstopError):
    """A gated call was made outside any run (no `estop.run(...)` context and no ESTOP_RUN)."""
