"""The reverse saga from Python: `@estop.effect(compensate=..., compensate_args=...)` declares how
a call is undone, and a `CompensationWorker` runs the undo the gate offers after a cancel —
newest first, with the arguments built from the forward call's result, the same idempotency key
on every attempt — until the run is `cancelled`. Against the session's real gate."""

from __future__ import annotations

import asyncio
import time

import estop

UNDO = '{"charge": result.id, "amount": args.amount}'


def _state(operator, run_id: str) -> str:
    return operator.status(run_id)["state"]


def test_a_cancel_runs_the_declared_undos_newest_first_and_the_run_ends_cancelled(gate, operator, run_id, daemon):
    charges: list[str] = []

    @estop.effect(tool="charge", compensate="refund_charge", compensate_args=UNDO)
    def charge(amount: int) -> dict[str, object]:
        charges.append(f"ch_{amount}")
        return {"id": f"ch_{amount}"}

    with gate.run(run_id):
        charge(10)
        charge(20)
    assert charges == ["ch_10", "ch_20"]

    undone: list[tuple[object, str]] = []

    async def refund_charge(args: object, idempotency_key: str) -> None:
        undone.append((args, idempotency_key))

    async def main() -> None:
        worker = estop.CompensationWorker(
            {"refund_charge": refund_charge}, run=run_id, socket=daemon.socket, token=daemon.agent_token
        )
        await worker.start()
        operator.cancel(run_id, reason="undo it")
        task = asyncio.create_task(worker.serve())
        deadline = time.monotonic() + 30
        while _state(operator, run_id) != "cancelled":
            assert time.monotonic() < deadline, (undone, operator.report(run_id))
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert [o for *_, o in worker.reported] == ["ok", "ok"]

    asyncio.run(main())
    # Newest first, each with its arguments built from its own result, and the derived key.
    assert [a for a, _ in undone] == [{"charge": "ch_20", "amount": 20}, {"charge": "ch_10", "amount": 10}]
    assert all(k.endswith("/undo") for _, k in undone)
    assert len({k for _, k in undone}) == 2


def test_a_failing_undo_is_retried_with_the_same_key_and_a_missing_handler_is_an_error(gate, operator, run_id, daemon):
    @estop.effect(tool="charge", compensate="refund_charge", compensate_args=UNDO)
    def charge(amount: int) -> dict[str, object]:
        return {"id": f"ch_{amount}"}

    with gate.run(run_id):
        charge(5)

    keys: list[str] = []

    def flaky(args: object, idempotency_key: str) -> None:  # sync handlers run too
        keys.append(idempotency_key)
        if len(keys) == 1:
            raise RuntimeError("the payment provider timed out")

    async def main() -> None:
        lonely = estop.CompensationWorker({}, run=run_id, socket=daemon.socket, token=daemon.agent_token)
        await lonely.start()
        operator.cancel(run_id)
        # A worker without the handler reports an error, saying which tool it lacks.
        event = await asyncio.wait_for(lonely._queue.get(), 30)
        assert await lonely.run_one(event) == "error"
        await lonely.client.close()
        worker = estop.CompensationWorker({"refund_charge": flaky}, run=run_id, socket=daemon.socket, token=daemon.agent_token)
        task = asyncio.create_task(worker.serve())
        deadline = time.monotonic() + 60
        while _state(operator, run_id) != "cancelled":
            assert time.monotonic() < deadline, (keys, operator.report(run_id))
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert [o for *_, o in worker.reported] == ["error", "ok"]

    asyncio.run(main())
    assert len(keys) == 2 and keys[0] == keys[1], keys
    report = operator.report(run_id)
    undo = [e for e in report["done"] if e.get("compensate") == "refund_charge"]
    assert undo and undo[0]["status"] == "compensated", report


def test_an_unknown_outcome_is_looked_up_first_and_undone_with_what_was_found(operator, run_id, daemon):
    """A declared lookup (policy `lookup`) answers an unknown outcome before anything is undone:
    found, the undo is built from what the lookup returned."""
    client = estop.Client(socket=daemon.socket, token=daemon.agent_token)
    v = client.admit(run_id, "p1", "saga_pay", args={"amount": 5})
    assert isinstance(v, estop.Admitted), v
    client.complete(run_id, "p1", v.token, "unknown", error="the connection dropped")
    seen: list[str] = []

    def find_payment(args: object, idempotency_key: str) -> dict[str, str]:
        seen.append(f"find {idempotency_key} {args}")
        return {"id": "pay_7"}

    async def unpay(args: object, idempotency_key: str) -> None:
        seen.append(f"unpay {args}")

    async def main() -> None:
        worker = estop.CompensationWorker(
            {"find_payment": find_payment, "unpay": unpay}, run=run_id, socket=daemon.socket, token=daemon.agent_token
        )
        await worker.start()
        operator.cancel(run_id)
        task = asyncio.create_task(worker.serve())
        deadline = time.monotonic() + 30
        while _state(operator, run_id) != "cancelled":
            assert time.monotonic() < deadline, (seen, operator.report(run_id))
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert [o for *_, o in worker.reported] == ["ok", "ok"]

    asyncio.run(main())
    assert seen == ["find p1 {'amount': 5}", "unpay {'payment': 'pay_7'}"]
