"""LangGraph: the five failure classes, without estop and through estop.adapters.langgraph."""

from __future__ import annotations

import asyncio
import operator
import threading
import time
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

import estop
from estop.adapters import langgraph as el

from .common import NEXT_TURN_AMOUNT, SIBLING_WORK_S, TOOL_DELAY_S, DECIDE_AFTER_S, Trial, interrupt_then_continue, leaks_after, stop_mid_tool


class S(TypedDict):
    log: Annotated[list, operator.add]


def _cfg(t: Trial) -> dict[str, Any]:
    return {"configurable": {"thread_id": t.run_id}}


def _graph(nodes: dict[str, Any], edges: list[tuple[str, str]], **compile_kw: Any) -> Any:
    g = StateGraph(S)
    for name, fn in nodes.items():
        g.add_node(name, fn)
    for a, b in edges:
        g.add_edge(a, b)
    return g.compile(checkpointer=InMemorySaver(), **compile_kw)


def _effects(t: Trial, guarded: bool) -> dict[str, Any]:
    """The world's side effects: plain functions, or the same functions gated by estop."""
    w = t.world

    def wire_money(to: str, amount: int) -> str:
        w.do("wire", amount)
        return "wired"

    def send_email(to: str) -> str:
        w.do("email", to)
        return "sent"

    def charge(amount: int) -> str:
        w.do("charge", amount)
        return f"ch_{amount}"

    fns = {"wire_money": wire_money, "send_email": send_email, "charge": charge}
    if guarded:
        fns = {k: el.effect(tool=k)(v) for k, v in fns.items()}

    async def acharge(amount: int) -> str:
        w.do("charge", amount)
        return f"ch_{amount}"

    fns["acharge"] = el.effect(tool="charge")(acharge) if guarded else acharge
    return fns


def sibling(t: Trial, guarded: bool) -> int:
    fx = _effects(t, guarded)

    def wire(state: S) -> dict:
        if guarded:
            try:
                fx["wire_money"]("acct-9", 100)  # held → interrupt(); decided in estop
            except estop.Refused:
                pass
        elif interrupt({"approve": "wire 100 to acct-9"}):
            fx["wire_money"]("acct-9", 100)
        return {"log": ["wire"]}

    def email(state: S) -> dict:
        time.sleep(SIBLING_WORK_S)
        fx["send_email"]("ops@example.com")
        return {"log": ["email"]}

    graph = _graph({"wire": wire, "email": email}, [(START, "wire"), (START, "email"), ("wire", END), ("email", END)])
    cfg = _cfg(t)
    if guarded:
        eg = el.EstopGraph(graph, t.gate)
        th = t.decide_later("reject", tool="wire_money")
        out = eg.invoke({"log": []}, cfg)
        assert "__interrupt__" in out
        th.join()
        eg.resume(cfg)
        assert t.world.count("email") == 1, "the sibling proceeds once the decision is made"
    else:
        out = graph.invoke({"log": []}, cfg)
        assert "__interrupt__" in out
        time.sleep(DECIDE_AFTER_S)
        t.world.mark("decided")
        graph.invoke(Command(resume=False), cfg)
    return t.world.count("email", before=t.world.marks["decided"])


def reject(t: Trial, guarded: bool) -> int:
    fx = _effects(t, guarded)

    def wire(state: S) -> dict:
        if guarded:
            try:
                fx["wire_money"]("acct-9", 100)
            except estop.Refused:
                return {"log": ["wire refused"]}
        elif interrupt({"approve": "wire 100 to acct-9"}):
            fx["wire_money"]("acct-9", 100)
        return {"log": ["wire"]}

    def pay_invoice(state: S) -> dict:
        # The model re-plans: "pay the invoice" reaches the same transfer through another tool
        # that nobody flagged for approval in the graph.
        try:
            fx["wire_money"]("acct-9", 100)
        except estop.Refused:
            return {"log": ["pay refused"]}
        return {"log": ["paid"]}

    graph = _graph({"wire": wire, "pay": pay_invoice}, [(START, "wire"), ("wire", "pay"), ("pay", END)])
    cfg = _cfg(t)
    if guarded:
        eg = el.EstopGraph(graph, t.gate)
        eg.invoke({"log": []}, cfg)
        p = t.pending("wire_money")
        t.world.mark("rejected")
        t.operator.reject(t.run_id, p["key"])
        eg.resume(cfg)
    else:
        graph.invoke({"log": []}, cfg)
        t.world.mark("rejected")
        graph.invoke(Command(resume=False), cfg)
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    fx = _effects(t, guarded)

    def checkout(state: S) -> dict:
        receipt = fx["charge"](42)
        # Ask the human to confirm shipping: on resume LangGraph re-runs the whole node.
        interrupt({"confirm_shipping": receipt})
        return {"log": [receipt]}

    graph = _graph({"checkout": checkout}, [(START, "checkout"), ("checkout", END)])
    cfg = _cfg(t)
    runner: Any = el.EstopGraph(graph, t.gate) if guarded else graph
    runner.invoke({"log": []}, cfg)
    runner.invoke(Command(resume=True), cfg)
    return t.world.count("charge") - 1


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause (see common.EXTRA_CLASSES): the thread's checkpoints are in a
    store both workers share; after the approval worker A resumes, transfers and dies inside the
    node; the job is redelivered and worker B resumes the same thread."""
    fx = _effects(t, guarded)
    crashes = [ConnectionError("worker lost")]
    saver = InMemorySaver()  # the durable checkpoint store

    def pay(state: S) -> dict:
        if not guarded:
            interrupt({"approve": "wire 100 to acct-9?"})  # LangGraph's own approval
        receipt = fx["wire_money"]("acct-9", 100)  # guarded: held by estop's policy (an interrupt)
        if crashes:
            raise crashes.pop()
        return {"log": [receipt]}

    def worker() -> Any:
        g = StateGraph(S)
        g.add_node("pay", pay)
        g.add_edge(START, "pay")
        g.add_edge("pay", END)
        graph = g.compile(checkpointer=saver)
        return el.EstopGraph(graph, t.gate) if guarded else graph

    cfg = _cfg(t)
    out = worker().invoke({"log": []}, cfg)
    assert "__interrupt__" in out, "expected the approval pause"
    if guarded:
        t.operator.approve(t.run_id, t.pending("wire_money")["key"])
    try:
        worker().invoke(Command(resume=True), cfg)
    except ConnectionError:
        pass
    worker().invoke(Command(resume=True), cfg)
    return t.world.count("wire") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    fx = _effects(t, guarded)
    done = threading.Event()

    def slow_refund(state: S) -> dict:
        try:
            time.sleep(TOOL_DELAY_S)  # a slow API call in a worker thread
            fx["charge"](-42)  # the refund lands after the step timed out
        except estop.Refused:
            pass
        finally:
            done.set()
        return {"log": ["refund"]}

    graph = _graph({"refund": slow_refund}, [(START, "refund"), ("refund", END)])
    graph.step_timeout = TOOL_DELAY_S / 3  # LangGraph's own timeout
    runner: Any = el.EstopGraph(graph, t.gate) if guarded else graph

    async def main() -> None:
        try:
            await runner.ainvoke({"log": []}, _cfg(t))
            raise AssertionError("expected the step timeout")
        except (TimeoutError, asyncio.TimeoutError):
            t.world.mark("stopped")

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def operator_cancel(t: Trial, guarded: bool) -> int:
    """The run is stopped while a sync node runs in a worker thread (LangGraph has no stop of its
    own: without estop the application's task cancel around `ainvoke`)."""
    fx = _effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    def slow_refund(state: S) -> dict:
        started.set()
        try:
            time.sleep(TOOL_DELAY_S)
            fx["charge"](-42)
        except estop.Refused:
            pass
        finally:
            done.set()
        return {"log": ["refund"]}

    graph = _graph({"refund": slow_refund}, [(START, "refund"), ("refund", END)])
    runner: Any = el.EstopGraph(graph, t.gate) if guarded else graph
    asyncio.run(stop_mid_tool(t, guarded, started, runner.ainvoke({"log": []}, _cfg(t))))
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def cancel_async(t: Trial, guarded: bool) -> int:
    fx = _effects(t, guarded)
    started = threading.Event()
    finished = threading.Event()

    async def write() -> None:
        try:
            await asyncio.sleep(TOOL_DELAY_S)
            await fx["acharge"](-42)
        except estop.Refused:
            pass
        finally:
            finished.set()

    async def refund(state: S) -> dict:
        started.set()
        await asyncio.shield(asyncio.ensure_future(write()))
        return {"log": ["refund"]}

    graph = _graph({"refund": refund}, [(START, "refund"), ("refund", END)])
    runner: Any = el.EstopGraph(graph, t.gate) if guarded else graph

    async def main() -> None:
        task = asyncio.ensure_future(runner.ainvoke({"log": []}, _cfg(t)))
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


def retry_policy(t: Trial, guarded: bool) -> int:
    from langgraph.types import RetryPolicy

    fx = _effects(t, guarded)
    attempts = []

    def checkout(state: S) -> dict:
        receipt = fx["charge"](42)
        attempts.append(receipt)
        if len(attempts) == 1:
            raise ConnectionError("the shipping API flaked after the charge")
        return {"log": [receipt]}

    g = StateGraph(S)
    g.add_node("checkout", checkout, retry_policy=RetryPolicy(max_attempts=3, initial_interval=0.01, jitter=False))
    g.add_edge(START, "checkout")
    g.add_edge("checkout", END)
    graph = g.compile(checkpointer=InMemorySaver())
    runner: Any = el.EstopGraph(graph, t.gate) if guarded else graph
    runner.invoke({"log": []}, _cfg(t))
    return t.world.count("charge") - 1


def next_turn(t: Trial, guarded: bool) -> None:
    """The user's next message on the same thread: a node that charges."""
    fx = _effects(t, guarded)
    graph = _graph({"pay": lambda s: {"log": [fx["charge"](NEXT_TURN_AMOUNT)]}}, [(START, "pay"), ("pay", END)])
    runner: Any = el.EstopGraph(graph, t.gate) if guarded else graph
    runner.invoke({"log": []}, _cfg(t))


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


SCENARIOS = {"operator_cancel": operator_cancel, "restart_pause": restart_pause, 
    "sibling": sibling,
    "reject": reject,
    "replay": replay,
    "cancel_thread": cancel_thread,
    "cancel_async": cancel_async,
    "interrupt_continue": interrupt_continue,
    "retry_policy": retry_policy,
}
