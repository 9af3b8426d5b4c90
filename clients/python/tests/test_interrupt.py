"""Interrupt is not cancel (seed 004): a local interruption of one invocation leaves the run
usable; only an explicit stop cancels it. Each test is a regression of issue 18: on the old code
every one of these interruptions sent a terminal cancel of the run, so the next turn was refused."""

from __future__ import annotations

import asyncio
import operator
import threading
from typing import Annotated, TypedDict

import pytest

import estop


class S(TypedDict):
    log: Annotated[list, operator.add]


def _graph(nodes, edges):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import StateGraph

    g = StateGraph(S)
    for name, fn in nodes.items():
        g.add_node(name, fn)
    for a, b in edges:
        g.add_edge(a, b)
    return g.compile(checkpointer=InMemorySaver())


def _charges(charged):
    from estop.adapters import langgraph as el

    @el.effect
    def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{amount}"

    return charge


def test_langgraph_breaking_out_of_stream_is_an_interrupt(gate, daemon, run_id):
    """Old: GeneratorExit was a stop signal, the thread was cancelled, `b` was refused."""
    from langgraph.graph import END, START

    from estop.adapters import langgraph as el

    charged = []
    charge = _charges(charged)
    graph = el.EstopGraph(_graph({"a": lambda s: {"log": [charge(1)]}, "b": lambda s: {"log": [charge(2)]}}, [(START, "a"), ("a", "b"), ("b", END)]), gate)
    cfg = {"configurable": {"thread_id": run_id}}
    for _chunk in graph.stream({"log": []}, cfg):
        break  # the user closed the tab after the first update
    assert charged == [1]
    out = graph.invoke(None, cfg)  # the next turn resumes the thread
    assert out["log"] == ["ch_1", "ch_2"] and charged == [1, 2]
    assert daemon.operator.status(run_id)["state"] == "active"


@pytest.mark.parametrize("signal", [KeyboardInterrupt, lambda: estop.EstopTimeout("the gate's reply was slow")])
def test_langgraph_ctrl_c_and_client_timeout_are_interrupts(gate, daemon, run_id, signal):
    """Old: KeyboardInterrupt and EstopTimeout (a TimeoutError) cancelled the run at the gate."""
    from langgraph.graph import END, START

    from estop.adapters import langgraph as el

    charged = []
    charge = _charges(charged)
    boom = [True]

    def pay(state):
        receipt = charge(5)
        if boom.pop() if boom else False:
            raise signal()
        return {"log": [receipt]}

    graph = el.EstopGraph(_graph({"pay": pay}, [(START, "pay"), ("pay", END)]), gate)
    cfg = {"configurable": {"thread_id": run_id}}
    with pytest.raises((KeyboardInterrupt, estop.EstopTimeout)):
        graph.invoke({"log": []}, cfg)
    assert graph.invoke(None, cfg)["log"] == ["ch_5"]
    assert charged == [5]  # the re-run node read its receipt
    assert daemon.operator.status(run_id)["state"] == "active"


def test_langgraph_explicit_cancel_stops_the_thread(gate, daemon, run_id):
    from langgraph.graph import END, START

    from estop.adapters import langgraph as el

    charged = []
    charge = _charges(charged)
    graph = el.EstopGraph(_graph({"pay": lambda s: {"log": [charge(len(charged) + 1)]}}, [(START, "pay"), ("pay", END)]), gate)
    cfg = {"configurable": {"thread_id": run_id}}
    graph.invoke({"log": []}, cfg)
    graph.cancel(cfg, "the user pressed stop")
    with pytest.raises(estop.RunStopped):
        graph.invoke({"log": []}, cfg)
    assert charged == [1] and daemon.operator.status(run_id)["state"] in ("cancelled", "finalizing")


def test_interrupted_invocation_refuses_at_once_while_its_task_is_cancelling(gate, run_id):
    """A task cancel counts from the instant it is requested, before the framework lets the
    CancelledError out (the old fence came only when `run()` returned: 3-43 ms late). The loop is
    blocked here, so the cancellation has been requested but not delivered."""
    charged = []
    go, asked = threading.Event(), threading.Event()
    result = {}

    @estop.effect
    def charge(amount: int) -> None:
        charged.append(amount)

    def worker(ctx):
        go.wait(5)
        try:
            ctx.run(charge, 1)
        except estop.Interrupted as e:
            result["refused"] = e
        asked.set()

    from estop.run import Invocation

    async def agent():
        async with gate.run(run_id) as run:
            with Invocation(run, owner=asyncio.current_task()):
                import contextvars

                threading.Thread(target=worker, args=(contextvars.copy_context(),)).start()
                await asyncio.sleep(30)

    async def main():
        task = asyncio.ensure_future(agent())
        await asyncio.sleep(0.05)
        task.cancel()
        go.set()
        asked.wait(5)  # blocks the loop: the task has not seen its CancelledError yet
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert charged == [] and result["refused"].local and result["refused"].reason == "interrupted"


async def test_openai_agents_after_turn_cancel_finishes_the_turn_then_stops(gate, daemon, run_id):
    """Old: `cancel("after_turn")` fenced the run at once, so the turn's own tool was refused."""
    from agents import Agent, function_tool
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    done = []

    @function_tool
    def refund(amount: int) -> str:
        """Refund."""
        done.append(amount)
        return "refunded"

    model = ScriptedModel([ModelStep(output=[function_call("refund", {"amount": 3}, call_id="a")]), ModelStep(output=[assistant_message("done")])])
    agent = Agent(name="a", model=model, tools=eo.gate_tools([refund]))
    streamed = eo.run_streamed(agent, "go", gate=gate, run_id=run_id)
    async for ev in streamed.stream_events():
        if getattr(ev, "type", "") == "run_item_stream_event" and getattr(ev, "name", "") == "tool_called":
            streamed.cancel("after_turn")
    assert done == [3]
    st = await asyncio.to_thread(daemon.operator.status, run_id)
    assert st["state"] in ("cancelled", "finalizing")


async def test_llamaindex_cancel_run_interrupts_and_stop_cancels(gate, daemon, run_id):
    """Old: `cancel_run()` (which LlamaIndex also uses to pause) cancelled the estop run."""
    from workflows import Workflow, step
    from workflows.events import StartEvent, StopEvent

    from estop.adapters import llamaindex as eli

    charged = []
    started = asyncio.Event()

    @estop.effect
    async def charge(amount: int) -> str:
        charged.append(amount)
        return "ok"

    class Slow(Workflow):
        @step
        async def go(self, ev: StartEvent) -> StopEvent:
            started.set()
            await asyncio.sleep(30)
            return StopEvent(result="never")

    class Pay(Workflow):
        @step
        async def go(self, ev: StartEvent) -> StopEvent:
            return StopEvent(result=await charge(9))

    await charge_in(gate, run_id, charge)  # the run exists at the gate
    h = eli.run(Slow(timeout=10), gate=gate, run_id=run_id)
    await started.wait()
    await h.cancel_run()
    with pytest.raises(Exception):
        await h
    assert await eli.run(Pay(timeout=10), gate=gate, run_id=run_id) == "ok"  # the run goes on
    h2 = eli.run(Slow(timeout=10), gate=gate, run_id=run_id)
    await h2.stop("done for good")
    with pytest.raises(Exception):
        await h2
    st = await asyncio.to_thread(daemon.operator.status, run_id)
    assert st["state"] in ("cancelled", "finalizing") and charged == [1, 9]


async def charge_in(gate, run_id, charge):
    async with gate.run(run_id):
        await charge(1)


def test_a_timeout_around_an_invocation_is_a_timeout_even_if_a_tool_reaches_the_gate_meanwhile(gate, run_id):
    """`asyncio.wait_for` cancels the invocation's task; a coroutine of that task that reaches the
    gate between the cancel's request and its delivery must let the cancel go on (the caller sees
    its `TimeoutError`), not raise `Interrupted` in its place (seen under load with LangChain's
    `ainvoke`: the tools node reached the gate after the timeout fired). Nothing is charged, and a
    task of the invocation that nobody cancelled still gets `Interrupted`."""
    from estop.run import Invocation

    charged, other = [], {}

    @estop.effect
    async def charge(amount: int) -> None:
        charged.append(amount)

    async def stray():  # a task the framework forgot: not cancelled, its invocation is over
        await asyncio.sleep(0.05)
        try:
            await charge(2)
        except estop.Interrupted as e:
            other["refused"] = e

    async def agent(run):
        with Invocation(run, owner=asyncio.current_task()):
            forgotten = asyncio.ensure_future(stray())
            asyncio.current_task().cancel()  # the timeout fired: requested, not delivered yet
            try:
                await charge(1)  # the tool reaches the gate before the cancel is delivered
            finally:
                await asyncio.shield(forgotten)

    async def main():
        async with gate.run(run_id) as run:
            with pytest.raises(asyncio.CancelledError):
                await agent(run)

    asyncio.run(main())
    assert charged == [] and other["refused"].reason == "interrupted"


def test_a_cancel_the_task_swallowed_before_the_invocation_is_not_an_interrupt(gate, run_id):
    """Code that caught its own task's CancelledError without `uncancel()` leaves
    `cancelling() > 0` for good; that old request must not interrupt later invocations."""
    from estop.adapters._common import aguarded

    charged = []

    @estop.effect
    async def charge(amount: int) -> None:
        charged.append(amount)

    async def agent():
        me = asyncio.current_task()
        me.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass  # swallowed, no uncancel(): me.cancelling() stays 1
        async with aguarded(gate.run(run_id)):
            await charge(1)

    asyncio.run(agent())
    assert charged == [1]
