"""OpenAI Agents SDK: the five failure classes, without estop and through
estop.adapters.openai_agents, driven by the SDK's own ScriptedModel (no network)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from agents import Agent, Runner, function_tool
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

import estop
from estop.adapters import openai_agents as eo

from .common import stop_mid_tool, DECIDE_AFTER_S, NEXT_TURN_AMOUNT, SIBLING_WORK_S, TOOL_DELAY_S, Trial, aswallow_refusal, effects, interrupt_then_continue, leaks_after, swallow_refusal


def _agent(tools: list[Any], steps: list[Any], guarded: bool, effects_map: dict[str, str] | None = None) -> Agent:
    model = ScriptedModel(steps)
    if guarded:
        tools = eo.gate_tools(tools, effects=effects_map)
    return Agent(name="ops", model=model, tools=tools)


async def _pause_then_resume(t: Trial, agent: Agent, result: Any) -> Any:
    """The native pause: the run ended with interruptions; wait for estop's decision, resume."""
    while result.interruptions:
        state = result.to_state()
        await eo.resolve(agent, state, gate=t.gate, run_id=t.run_id, timeout_s=10)
        result = await eo.run(agent, state, gate=t.gate, run_id=t.run_id)
    return result


def _done() -> ModelStep:
    return ModelStep(output=[assistant_message("done")])


def sibling(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)

    @function_tool(needs_approval=True)
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        return fx["wire_money"](to, amount) if not guarded else "wired"

    @function_tool
    def notify(to: str) -> str:
        """Tell someone."""
        time.sleep(SIBLING_WORK_S)
        return swallow_refusal(fx["send_email"], to)

    if guarded:
        # The tool call itself is the transfer: gate it as such (its body is the API call).
        @function_tool(needs_approval=True)
        def wire_money(to: str, amount: int) -> str:  # noqa: F811
            """Wire money."""
            t.world.do("wire", amount)
            return "wired"

    steps = [ModelStep(output=[function_call("wire_money", {"to": "acct-9", "amount": 100}, call_id="c1"), function_call("notify", {"to": "ops@example.com"}, call_id="c2")]), _done()]
    agent = _agent([wire_money, notify], steps, guarded)

    async def main() -> None:
        if guarded:
            # The hold is the SDK's own interruption; the operator decides in estop.
            th = t.decide_later("reject", tool="wire_money")
            await _pause_then_resume(t, agent, await eo.run(agent, "go", gate=t.gate, run_id=t.run_id))
            th.join()
            assert t.world.count("email") == 1, "the sibling proceeds once the decision is made"
        else:
            r = await Runner.run(agent, "go")
            assert r.interruptions
            await asyncio.sleep(DECIDE_AFTER_S)
            t.world.mark("decided")
            st = r.to_state()
            for it in r.interruptions:
                st.reject(it)
            await Runner.run(agent, st)

    asyncio.run(main())
    return t.world.count("email", before=t.world.marks["decided"])


def reject(t: Trial, guarded: bool) -> int:
    def transfer(to: str, amount: int) -> str:
        t.world.do("wire", amount)
        return "wired"

    @function_tool(needs_approval=True)
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        return transfer(to, amount)

    @function_tool
    def pay_invoice(to: str, amount: int) -> str:
        """Pay an invoice (moves money too; nobody flagged it for approval)."""
        return transfer(to, amount)

    steps = [
        ModelStep(output=[function_call("wire_money", {"to": "acct-9", "amount": 100}, call_id="c1")]),
        ModelStep(output=[function_call("pay_invoice", {"to": "acct-9", "amount": 100}, call_id="c2")]),
        _done(),
    ]
    # With estop both tools are the same effect at the gate: "wire_money".
    agent = _agent([wire_money, pay_invoice], steps, guarded, effects_map={"pay_invoice": "wire_money"})

    async def main() -> None:
        if guarded:
            def operator() -> None:
                p = t.pending("wire_money")
                t.world.mark("rejected")
                t.operator.reject(t.run_id, p["key"])

            th = threading.Thread(target=operator)
            th.start()
            await _pause_then_resume(t, agent, await eo.run(agent, "go", gate=t.gate, run_id=t.run_id))
            th.join()
        else:
            r = await Runner.run(agent, "go")
            t.world.mark("rejected")
            st = r.to_state()
            for it in r.interruptions:
                st.reject(it)
            await Runner.run(agent, st)

    asyncio.run(main())
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    @function_tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        t.world.do("charge", amount)
        return f"ch_{amount}"

    def steps() -> list[Any]:
        # The worker dies after the charge, before the run finished (the model call fails);
        # the job queue redelivers the job, which runs the agent again for the same order.
        return [ModelStep(output=[function_call("charge", {"amount": 42}, call_id="c1")]), ModelStep.raise_error(ConnectionError("worker lost"))]

    async def attempt(steps_: list[Any]) -> None:
        agent = _agent([charge], steps_, guarded)
        try:
            if guarded:
                await eo.run(agent, "charge order 42", gate=t.gate, run_id=t.run_id)
            else:
                await Runner.run(agent, "charge order 42")
        except ConnectionError:
            pass

    asyncio.run(attempt(steps()))
    asyncio.run(attempt([ModelStep(output=[function_call("charge", {"amount": 42}, call_id="c1")]), _done()]))
    return t.world.count("charge") - 1


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause: the paused run's RunState is saved; after the approval the
    worker resumes it, the transfer runs, and the worker dies before it can save the finished
    run (the model call after the tool fails); the job is redelivered from the saved pause and
    resumed again. Leak: extra transfers."""
    from agents import RunState

    @function_tool(needs_approval=True)
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        t.world.do("wire", amount)
        return "wired"

    first = [ModelStep(output=[function_call("wire_money", {"to": "acct-9", "amount": 100}, call_id="w1")])]

    async def resume(saved: str, steps: list[Any]) -> None:
        agent = _agent([wire_money], steps, guarded)
        state = await RunState.from_string(agent, saved)
        try:
            if guarded:
                await eo.resolve(agent, state, gate=t.gate, run_id=t.run_id, timeout_s=10)
                await eo.run(agent, state, gate=t.gate, run_id=t.run_id)
            else:
                for item in state.get_interruptions():
                    state.approve(item)  # the human approved (the approval is in the saved job)
                await Runner.run(agent, state)
        except ConnectionError:
            pass

    async def main() -> None:
        agent = _agent([wire_money], list(first), guarded)
        r = await (eo.run(agent, "pay", gate=t.gate, run_id=t.run_id) if guarded else Runner.run(agent, "pay"))
        assert r.interruptions, "expected the approval pause"
        saved = r.to_state().to_string()
        if guarded:
            await asyncio.to_thread(t.operator.approve, t.run_id, t.pending("wire_money")["key"])
        await resume(saved, [ModelStep.raise_error(ConnectionError("worker lost"))])
        await resume(saved, [_done()])

    asyncio.run(main())
    return t.world.count("wire") - 1


def timeout_retry(t: Trial, guarded: bool) -> int:
    """The SDK's own tool timeout (`@function_tool(timeout=...)`, async tools only) on an async
    tool whose blocking payment call runs in a worker thread: the timeout returns an error to
    the model, the thread goes on and charges, and the model retries the call. The tool call is
    the effect (`eo.gate_tools`). Leak: extra charges."""
    threads = []

    def slow_charge(amount: int) -> str:
        threads.append(1)
        try:
            time.sleep(TOOL_DELAY_S)  # a slow payment API: past the SDK's timeout
            t.world.do("charge", amount)
            return "ch_42"
        finally:
            threads.pop()

    @function_tool(timeout=TOOL_DELAY_S / 3)
    async def charge(amount: int) -> str:
        """Charge the customer."""
        return await asyncio.to_thread(slow_charge, amount)

    step = lambda cid: ModelStep(output=[function_call("charge", {"amount": 42}, call_id=cid)])  # noqa: E731
    agent = _agent([charge], [step("c1"), step("c2"), _done()], guarded)  # the model retries the charge
    asyncio.run(eo.run(agent, "charge", gate=t.gate, run_id=t.run_id) if guarded else Runner.run(agent, "charge"))
    time.sleep(0.01)
    t.wait_for(lambda: not threads)  # every abandoned thread has finished
    return t.world.count("charge") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    done = threading.Event()

    @function_tool
    def refund(amount: int) -> str:
        """Refund (a slow API in a worker thread)."""
        try:
            time.sleep(TOOL_DELAY_S)
            return swallow_refusal(fx["charge"], -amount)
        finally:
            done.set()

    agent = _agent([refund], [ModelStep(output=[function_call("refund", {"amount": 42}, call_id="c1")]), _done()], guarded)

    async def main() -> None:
        # The SDK's own tool timeout is for async tools only; a sync tool is bounded by the
        # caller's timeout around the run.
        try:
            if guarded:
                await eo.run(agent, "refund", gate=t.gate, run_id=t.run_id, timeout_s=TOOL_DELAY_S / 3)
            else:
                await asyncio.wait_for(Runner.run(agent, "refund"), TOOL_DELAY_S / 3)
            raise AssertionError("expected the timeout")
        except (TimeoutError, asyncio.TimeoutError):
            t.world.mark("stopped")

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def _slow_refund(t: Trial, guarded: bool) -> tuple[Any, threading.Event, threading.Event]:
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    @function_tool
    def refund(amount: int) -> str:
        """Refund (a slow API in a worker thread)."""
        started.set()
        try:
            time.sleep(TOOL_DELAY_S)
            return swallow_refusal(fx["charge"], -amount)
        finally:
            done.set()

    agent = _agent([refund], [ModelStep(output=[function_call("refund", {"amount": 42}, call_id="c1")]), _done()], guarded)
    return agent, started, done


def operator_cancel(t: Trial, guarded: bool) -> int:
    agent, started, done = _slow_refund(t, guarded)
    run = eo.run(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else Runner.run(agent, "refund")
    asyncio.run(stop_mid_tool(t, guarded, started, run))
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def framework_cancel(t: Trial, guarded: bool) -> int:
    """The SDK's own stop, `streamed.cancel()`, while a thread tool is mid-work."""
    agent, started, done = _slow_refund(t, guarded)

    async def main() -> None:
        streamed = eo.run_streamed(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else Runner.run_streamed(agent, "refund")

        async def consume() -> None:
            async for _ in streamed.stream_events():
                pass

        task = asyncio.ensure_future(consume())
        while not started.is_set():
            await asyncio.sleep(0.005)
        streamed.cancel()
        t.world.mark("stopped")
        with contextlib.suppress(BaseException):
            await task

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def cancel_async(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    started = threading.Event()
    finished = threading.Event()

    async def write(amount: int) -> None:
        try:
            await asyncio.sleep(TOOL_DELAY_S)
            await aswallow_refusal(fx["acharge"], -amount)
        finally:
            finished.set()

    @function_tool
    async def refund(amount: int) -> str:
        """Refund (async API; the write is shielded so it is never half-done)."""
        started.set()
        await asyncio.shield(asyncio.ensure_future(write(amount)))
        return "refunded"

    agent = _agent([refund], [ModelStep(output=[function_call("refund", {"amount": 42}, call_id="c1")]), _done()], guarded)

    async def main() -> None:
        coro = eo.run(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else Runner.run(agent, "refund")
        task = asyncio.ensure_future(coro)
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()  # the user pressed stop
        try:
            await task
        except asyncio.CancelledError:
            t.world.mark("stopped")
        while not finished.is_set():
            await asyncio.sleep(0.005)

    asyncio.run(main())
    return leaks_after(t.world, "charge", "stopped")


def next_turn(t: Trial, guarded: bool) -> None:
    """The next turn of the same conversation (run id): the model charges."""

    @function_tool
    def charge(amount: int) -> str:
        """Charge."""
        t.world.do("charge", amount)
        return "charged"

    agent = _agent([charge], [ModelStep(output=[function_call("charge", {"amount": NEXT_TURN_AMOUNT}, call_id="n1")]), _done()], guarded)
    asyncio.run(eo.run(agent, "charge", gate=t.gate, run_id=t.run_id) if guarded else Runner.run(agent, "charge"))


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


SCENARIOS = {"timeout_retry": timeout_retry, "operator_cancel": operator_cancel, "framework_cancel": framework_cancel, "restart_pause": restart_pause, "sibling": sibling, "reject": reject, "replay": replay, "cancel_thread": cancel_thread, "cancel_async": cancel_async, "interrupt_continue": interrupt_continue}
