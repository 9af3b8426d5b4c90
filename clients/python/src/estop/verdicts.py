"""Verdicts of `admit`, `wait` and `start` as typed objects (docs/PROTOCOL.md, "Verdicts")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

__all__ = ["Admitted", "Go", "Held", "RefusedVerdict", "Duplicate", "Verdict", "parse_verdict"]


@dataclass(frozen=True)
class Admitted:
    """Go ahead (prepared, with `start=false`)."""

    token: str
    epoch: int


@dataclass(frozen=True)
class Go:
    """`start` only: run it now."""


@dataclass(frozen=True)
class Held:
    """Not yet. `reason`: approval | sibling | paused."""

    reason: str
    approval: str | None = None
    expires_at: int | None = None


@dataclass(frozen=True)
class RefusedVerdict:
    """Never, for this effect."""

    reason: str
    message: str | None = None
    rule: str | None = None
    budget: dict[str, Any] | None = None
    """reason `budget`: `{dimension, run, limit, used}`, the model budget the call's `reserve` would
    pass (`model_usd` or `model_tokens`, the nearest run whose limit it is)."""


@dataclass(frozen=True)
class Duplicate:
    """This identity was admitted before; `status` is in_progress/started while the first has not
    completed, else the recorded status with its outcome."""

    status: str
    outcome: str | None = None
    result: Any = None
    error: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


Verdict = Union[Admitted, Go, Held, RefusedVerdict, Duplicate]


def parse_verdict(reply: dict[str, Any]) -> Verdict:
    v = reply.get("verdict")
    if v == "admitted":
        return Admitted(token=str(reply["token"]), epoch=int(reply.get("epoch") or 0))
    if v == "go":
        return Go()
    if v == "held":
        return Held(
            reason=str(reply.get("reason") or "approval"),
            approval=reply.get("approval"),
            expires_at=reply.get("expires_at"),
        )
    if v == "refused":
        return RefusedVerdict(
            reason=str(reply.get("reason")),
            message=reply.get("message"),
            rule=reply.get("rule"),
            budget=reply.get("budget"),
        )
    if v == "duplicate":
        return Duplicate(
            status=str(reply.get("status")),
            outcome=reply.get("outcome"),
            result=reply.get("result"),
            error=reply.get("error"),
            raw=reply,
        )
    raise ValueError(f"unknown verdict in reply: {reply!r}")
