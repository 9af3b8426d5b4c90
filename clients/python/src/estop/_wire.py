"""Protocol v1 framing shared by the sync and asyncio clients: request lines, reply decoding."""

from __future__ import annotations

import json
from typing import Any

from .errors import LineTooLong, error_from_reply
from .verdicts import Verdict, parse_verdict

#: Ops that are safe to send again after a lost reply (the gate answers a repeat from its state).
#: `decide` and `token` are not: a second approval is `conflict`, a second token a new secret.
IDEMPOTENT_OPS = frozenset(
    {
        "hello",
        "ping",
        "admit",
        "start",
        "complete",
        "wait",
        "subscribe",
        "unsubscribe",
        "status",
        "cancel",
        "close",
        "runs",
        "pending",
        "report",
        "ledger",
        "pause",
        "resume",
        "kill",
    }
)

_MISSING: Any = object()


def request_line(rid: int, op: str, fields: dict[str, Any]) -> bytes:
    req: dict[str, Any] = {"id": rid, "op": op}
    for k, v in fields.items():
        if v is _MISSING:
            continue
        if v is None and k not in ("args", "result"):
            continue
        req[k] = v
    return (json.dumps(req, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()


def fit_line(op: str, line: bytes, line_bytes_max: int) -> bytes:
    """The line, if the gate will read it; `LineTooLong` here, before the wire, if not (the gate
    would discard it unread and answer with `id: null`)."""
    if len(line) - 1 > line_bytes_max:
        raise LineTooLong(
            "line_too_long", f"{op} request is {len(line) - 1} bytes, over line_bytes_max {line_bytes_max}; not sent"
        )
    return line


def unread_line_owner(msg: dict[str, Any], sent: dict[int, tuple[str, int]]) -> int | None:
    """The request an `id: null` refusal answers (docs/PROTOCOL.md, "Reconnecting"), among those
    `sent` on the connection and not answered yet (id -> (op, line bytes)); None when it answers
    none (a notice before the gate closes the connection: idle, revoked, evicted).

    `line_too_long`: the longest line in flight — every line longer than the one refused is over
    the bound too and gets its own refusal, so the requests failed are exactly those refused.
    `bad_json`: the oldest request in flight, a parked `wait` last (it was read long ago)."""
    if msg.get("ok") is not False or not sent:
        return None
    code = (msg.get("error") or {}).get("code")
    if code == "line_too_long":
        return max(sent, key=lambda rid: (sent[rid][1], -rid))
    if code == "bad_json":
        return min(sent, key=lambda rid: (sent[rid][0] == "wait", rid))
    return None


def is_terminal(event: dict[str, Any]) -> bool:
    """An event (or a `subscribed` replay) saying the run stopped: nothing more to re-subscribe."""
    kind = event.get("event")
    return kind in ("cancelled", "closed") or (kind == "subscribed" and event.get("cause") is not None)


def error_text(msg: dict[str, Any]) -> str:
    err = msg.get("error") or {}
    return f"{err.get('code', 'internal')}: {err.get('message', '')}"


def replay_event(run: str, reply: dict[str, Any]) -> dict[str, Any] | None:
    """What a `subscribe` reply replays of the run (its state when the subscription took hold:
    stopped and why, the effects awaiting a decision), as the `subscribed` line the clients hand
    their listeners; None for the plain ack (a run not created yet, or not this principal's)."""
    if "state" not in reply:
        return None
    ev = {k: v for k, v in reply.items() if k not in ("id", "ok")}
    ev["event"] = "subscribed"
    ev["run"] = run
    return ev


#: The lists of a report; each page of a report holds those of its own effects.
REPORT_LISTS = (
    "done",
    "failed",
    "refused",
    "in_flight",
    "unknown",
    "compensable",
    "irreversible",
    "undeclared",
    "held",
)


def merge_page(acc: dict[str, Any] | None, page: dict[str, Any], lists: tuple[str, ...]) -> dict[str, Any]:
    """Appends a listing page's `lists` to those of the pages before it (docs/PROTOCOL.md,
    "Pages"); the result keeps the last page's `more`/`next`."""
    if acc is None:
        return dict(page)
    for k in lists:
        acc[k] = list(acc.get(k, [])) + list(page.get(k, []))
    for k in ("more", "next"):
        if k in page:
            acc[k] = page[k]
        else:
            acc.pop(k, None)
    return acc


#: The gate's default `line_bytes_max` (docs/PROTOCOL.md, "Limits").
LINE_BYTES_MAX = 65536


def fit_admit(fields: dict[str, Any], line_bytes_max: int) -> dict[str, Any]:
    """An admit whose arguments would make the line too long sends their digest instead (the
    gate binds approvals and receipts to the digest either way; a tool whose policy has a `when`
    then answers `args_required`)."""
    if "args" not in fields:
        return fields
    size = len(request_line(0, "admit", fields))
    if size <= line_bytes_max - 64:
        return fields
    from ._jcs import digest

    out = dict(fields)
    out["digest"] = digest(fields["tool"], out.pop("args"))
    return out


def check(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok") is True:
        return reply
    raise error_from_reply(reply)


def verdict(reply: dict[str, Any]) -> Verdict:
    return parse_verdict(check(reply))


def admit_fields(
    run: str,
    key: str,
    tool: str,
    args: Any,
    digest: str | None,
    start: bool,
    parent: str | None,
    labels: dict[str, str] | None,
    needs_approval: bool | None,
    limits: dict[str, int] | None,
    declare: dict[str, str] | None = None,
    reserve: dict[str, int] | None = None,
) -> dict[str, Any]:
    f: dict[str, Any] = {"run": run, "key": key, "tool": tool, "start": start}
    if digest is not None:
        f["digest"] = digest
    else:
        f["args"] = args
    f["parent"] = parent
    f["labels"] = labels or None
    f["needs_approval"] = True if needs_approval else None
    f["limits"] = limits or None
    f["declare"] = declare or None
    f["reserve"] = spend_fields("reserve", reserve)
    return f


SPEND_MAX = 10**12


def spend_fields(name: str, v: dict[str, int] | None) -> dict[str, int] | None:
    """A `reserve` or `cost` (docs/PROTOCOL.md, "Model budget"): `{usd_micros?, tokens?}`, each a
    whole number from 0 to 10**12; anything else is a `ValueError` here, before the wire."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"{name} must be a dict with usd_micros and/or tokens, not {type(v).__name__}")
    out: dict[str, int] = {}
    for k, n in v.items():
        if k not in ("usd_micros", "tokens"):
            raise ValueError(f"{name} has {k!r}; only usd_micros and tokens are counted")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= SPEND_MAX:
            raise ValueError(f"{name}.{k} must be a whole number from 0 to 10**12, not {n!r}")
        out[k] = n
    return out or None
