"""The reverse saga's executor on the client side: after a cancel, the gate offers each
completed compensable effect's compensation, newest first (docs/PROTOCOL.md, "compensations").
A `CompensationWorker` runs the handler registered for the compensating tool and reports how it
ended. It keeps a connection of its own, so it goes on while the agent that was cancelled stops::

    async def refund_charge(args, idempotency_key):
        await stripe.refunds.create(charge=args["charge"], idempotency_key=idempotency_key)

    worker = estop.CompensationWorker({"refund_charge": refund_charge})
    await worker.serve()          # until cancelled

Pass `idempotency_key` to the system the handler reaches: an attempt that landed but was not
reported (a crash, a lost connection) is offered again with the same key. A handler that
returns reports `ok`; one that raises reports `error` (retried by the gate with backoff, then a
human is asked); `estop.CompensationUnknown` reports `unknown` (whether it landed is not known:
a human is asked at once). A tool with no handler here is reported `error` with that reason.

The gate also asks declared lookups (policy `lookup = "tool"`) about a call whose outcome is
unknown, before undoing anything older: a lookup handler gets the forward call's args and its own
idempotency key, and returns what the call returned if it happened (reported `ok`, recorded as
its result), or `None` if it did not (`error`: nothing to undo); one that raises, or a lookup
tool with no handler here, is reported `unknown` (an operator settles it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .aio import AsyncClient
from .errors import EstopError

log = logging.getLogger("estop")

__all__ = ["CompensationWorker", "CompensationUnknown"]

Handler = Callable[[Any, str], "Awaitable[Any] | Any"]

_ERROR_BYTES_MAX = 4096


class CompensationUnknown(EstopError):
    """Raised by a handler that cannot tell whether its compensation took effect."""


class CompensationWorker:
    def __init__(
        self,
        handlers: Mapping[str, Handler],
        *,
        run: str | None = None,
        client: AsyncClient | None = None,
        **client_kw: Any,
    ) -> None:
        """`handlers`: compensating tool → `handler(args, idempotency_key)` (sync or async).
        `run`: only this run's compensations (default: every run the token's principal sees).
        `client`: an `AsyncClient` of its own (default: one from the environment)."""
        self.handlers = dict(handlers)
        self.run = run
        self.client = client or AsyncClient(**client_kw)
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        #: (run, key, attempt, outcome) of every attempt reported, in order.
        self.reported: list[tuple[str, str, int, str]] = []

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") in ("compensate", "lookup") and (self.run is None or event.get("run") == self.run):
            self._queue.put_nowait(event)

    async def start(self) -> "CompensationWorker":
        """Connects and registers as an executor; `compensate` events queue from then on."""
        self.client.add_listener(self._on_event)
        await self.client.connect()
        await self.client.compensations(self.run)
        return self

    async def serve(self) -> None:
        """Runs compensations as the gate offers them, until cancelled."""
        if not self.client._executes:
            await self.start()
        try:
            while True:
                await self.run_one(await self._queue.get())
        finally:
            self.client.remove_listener(self._on_event)
            await self.client.close()

    async def run_one(self, event: dict[str, Any]) -> str:
        """Runs one offered compensation (or lookup) and reports it; returns the outcome reported."""
        if event.get("event") == "lookup":
            return await self._look_up(event)
        run, key, attempt = event["run"], event["key"], int(event["attempt"])
        tool, idem = event.get("tool", ""), event["idempotency_key"]
        handler = self.handlers.get(tool)
        error: str | None = None
        if handler is None:
            outcome, error = "error", f"no handler for {tool!r} in this worker (it has {sorted(self.handlers)})"
        else:
            try:
                if inspect.iscoroutinefunction(handler):
                    await handler(event.get("args"), idem)
                else:
                    # A blocking handler runs on a thread: the connection keeps being read.
                    result = await asyncio.to_thread(handler, event.get("args"), idem)
                    if inspect.isawaitable(result):
                        await result
                outcome = "ok"
            except CompensationUnknown as e:
                outcome, error = "unknown", str(e) or "the handler could not tell whether it took effect"
            except Exception as e:  # noqa: BLE001 - any failure of the handler is the attempt's
                outcome, error = "error", f"{type(e).__name__}: {e}"
        if error is not None:
            error = error.encode()[:_ERROR_BYTES_MAX].decode(errors="ignore")
            log.warning("estop: compensation %s of %s/%s attempt %d: %s: %s", tool, run, key, attempt, outcome, error)
        await self.client.compensated(run, key, attempt, outcome, error)
        self.reported.append((run, key, attempt, outcome))
        return outcome

    async def _look_up(self, event: dict[str, Any]) -> str:
        """Asks a lookup handler whether the call with this key happened, and reports it."""
        run, key, attempt = event["run"], event["key"], int(event["attempt"])
        tool, idem = event.get("tool", ""), event["idempotency_key"]
        handler = self.handlers.get(tool)
        result: Any = None
        error: str | None = None
        if handler is None:
            outcome, error = "unknown", f"no handler for {tool!r} in this worker (it has {sorted(self.handlers)})"
        else:
            try:
                if inspect.iscoroutinefunction(handler):
                    result = await handler(event.get("args"), idem)
                else:
                    result = await asyncio.to_thread(handler, event.get("args"), idem)
                    if inspect.isawaitable(result):
                        result = await result
                outcome = "error" if result is None else "ok"
            except Exception as e:  # noqa: BLE001 - a lookup that fails cannot tell
                outcome, error = "unknown", f"{type(e).__name__}: {e}"
        if error is not None:
            error = error.encode()[:_ERROR_BYTES_MAX].decode(errors="ignore")
            log.warning("estop: lookup %s of %s/%s attempt %d: %s: %s", tool, run, key, attempt, outcome, error)
        # `result` only when found: a null result would say it happened (the gate refuses it).
        found = {"result": result} if outcome == "ok" else {}
        await self.client.call("looked_up", run=run, key=key, attempt=attempt, outcome=outcome, error=error, **found)
        self.reported.append((run, key, attempt, outcome))
        return outcome
