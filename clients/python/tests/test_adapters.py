"""Adapter paths the failure-class scenarios do not cover: approvals that are granted, the
LangGraph approver, PydanticAI deferred holds, LlamaIndex hold events, a daemon restart."""

from __future__ import annotations

import asyncio
import operator
import threading
import time
from typing import Annotated, TypedDict

import pytest

import estop
from estop.testing import Daemon

from .conftest import POLICY
from .test_effect import wait_pending


class S(TypedDict):
    log: Annotated[list, operator.add]


def test_langgraph_approve_and_approver(gate, daemon, run_id):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Command

    from estop.adapters import langgraph as el

    done = []

    @el.effect(tool="wire_money", approver=daemon.operator)
    def wire_money(to: str, amount: int) -> str:
        done.append(("wire", amount))
        return "wired"

    @el.effect
    def send_email(to: str) -> str:
        done.append(("email", to))
        return "sent"

    g = StateGraph(S)
    g.add_node("pay", lambda s: {"log": [wire_money("acct", 7)]})
    g.add_node("notify", lambda s: (time.sleep(0.05), {"log": [send_email("ops")]})[1])
    for n in ("pay", "notify"):
        g.add_edge(START, n)
        g.add_edge(n, END)
    graph = el.EstopGraph(g.compile(checkpointer=InMemorySaver()), gate)
    cfg = {"configurable": {"thread_id": run_id}}
    out = graph.invoke({"log": []}, cfg)
    reasons = sorted(i.value["estop"]["reason"] for i in out["__interrupt__"])
    assert reasons == ["approval", "sibling"] and done == []
    # The approval UI resumes with a decision; the adapter records it as the operator's.
    pay = next(i for i in graph.pending_interrupts(cfg) if i.value["estop"]["reason"] == "approval")
    out = graph.invoke(Command(resume={i.id: {"decision": "approve"} for i in graph.pending_interrupts(cfg)}), cfg)
    assert pay.value["estop"]["tool"] == "wire_money"
    if "__interrupt__" in out:  # the sibling re-asked before the decision landed: resume again
        out = graph.resume(cfg)
    assert sorted(out["log"]) == ["sent", "wired"]
    assert sorted(done) == [("email", "ops"), ("wire", 7)]


def test_langgraph_wait_mode_outside_graph(gate, daemon, run_id):
    from estop.adapters import langgraph as el

    @el.effect(tool="wire_money")
    def wire_money(amount: int) -> str:
        return "wired"

    with gate.run(run_id):
        th = threading.Thread(target=lambda: daemon.operator.approve(run_id, wait_pending(daemon.operator, run_id)["key"]))
        th.start()
        assert wire_money(5) == "wired"  # not in a graph: the hold blocks until decided
        th.join()


async def test_pydantic_ai_defer_mode(gate, daemon, run_id):
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.toolsets import FunctionToolset

    from estop.adapters import pydantic_ai as ep

    ran = []

    def wire_money(to: str, amount: int) -> str:
        ran.append(amount)
        return "wired"

    def llm(messages, info):
        if sum(isinstance(m, ModelResponse) for m in messages) == 0:
            return ModelResponse(parts=[ToolCallPart("wire_money", {"to": "a", "amount": 9}, tool_call_id="c1")])
        return ModelResponse(parts=[TextPart("ok")])

    toolset = ep.EstopToolset(FunctionToolset([wire_money]), on_hold="defer")
    agent = Agent(FunctionModel(llm), toolsets=[toolset], output_type=[str, DeferredToolRequests])
    r = await ep.run(agent, "pay", gate=gate, run_id=run_id)
    assert isinstance(r.output, DeferredToolRequests) and ran == []
    meta = r.output.metadata["c1"]["estop"]
    assert meta["reason"] == "approval" and meta["tool"] == "wire_money"
    await asyncio.to_thread(daemon.operator.approve, run_id, meta["key"])
    # Run the same turn again (a new run of the agent for the same run id): same key, admitted.
    agent2 = Agent(FunctionModel(llm), toolsets=[toolset], output_type=[str, DeferredToolRequests])
    r2 = await ep.run(agent2, "pay", gate=gate, run_id=run_id)
    assert r2.output == "ok" and ran == [9]


async def test_llamaindex_hold_event(gate, daemon, run_id):
    from workflows import Context, Workflow, step
    from workflows.events import StartEvent, StopEvent

    from estop.adapters import llamaindex as eli

    @eli.effect(tool="wire_money")
    async def wire(to: str, amount: int, ctx: Context | None = None) -> str:
        return "wired"

    class W(Workflow):
        @step
        async def go(self, ctx: Context, ev: StartEvent) -> StopEvent:
            return StopEvent(result=await wire("a", 3, ctx=ctx))

    h = eli.run(W(timeout=10), gate=gate, run_id=run_id)
    async for ev in h.stream_events():
        if isinstance(ev, eli.EstopHeld):
            assert ev.estop["reason"] == "approval"
            await asyncio.to_thread(daemon.operator.approve, run_id, ev.estop["key"])
    assert await h == "wired"


async def test_llamaindex_step_retry_policy_with_a_named_step(gate, run_id):
    """A step's `retry_policy` runs it again after a failure; effects inside `estop.step(name)`
    named for the work (each attempt starts a fresh count) present the first attempt's key on the
    retry and read its receipt."""
    from workflows import Workflow, step
    from workflows.events import StartEvent, StopEvent
    from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

    import estop
    from estop.adapters import llamaindex as eli

    charged: list[int] = []
    runs: list[str] = []

    @estop.effect(tool="charge")
    async def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{amount}"

    class W(Workflow):
        @step(retry_policy=retry_policy(wait=wait_fixed(0.01), stop=stop_after_attempt(3)))
        async def checkout(self, ev: StartEvent) -> StopEvent:
            with estop.step("checkout:order-42"):
                receipt = await charge(42)
            runs.append(receipt)
            if len(runs) == 1:
                raise ConnectionError("the shipping API flaked after the charge")
            return StopEvent(result=receipt)

    assert await eli.run(W(timeout=10), gate=gate, run_id=run_id) == "ch_42"
    assert runs == ["ch_42", "ch_42"]
    assert charged == [42]


@pytest.mark.parametrize("sync", [False, True], ids=["async-step", "sync-step"])
async def test_llamaindex_step_retry_policy_reuses_the_key(gate, run_id, sync):
    """A step's `retry_policy` runs it again after it charged, then failed: `eli.run` links the
    retry to the failed attempt (`ctx.retry_info().last_exception` is the exception it raised),
    so the retry's charge presents the first attempt's key and reads its receipt (without the
    link it was a second occurrence in the run: a new key, a second charge). A second charge of
    the same amount in the retry is a second call, and so a new effect."""
    from workflows import Workflow, step
    from workflows.events import StartEvent, StopEvent
    from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

    import estop
    from estop.adapters import llamaindex as eli

    charged: list[int] = []
    runs: list[str] = []

    def _charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{amount}_{len(charged)}"

    async def _acharge(amount: int) -> str:
        return _charge(amount)

    charge = estop.effect(tool="charge")(_charge)
    acharge = estop.effect(tool="charge")(_acharge)

    def attempt(receipt: str) -> None:
        runs.append(receipt)
        if len(runs) == 1:
            raise ConnectionError("the shipping API flaked after the charge")

    policy = retry_policy(wait=wait_fixed(0.01), stop=stop_after_attempt(3))
    if sync:

        class W(Workflow):
            @step(retry_policy=policy)
            def checkout(self, ev: StartEvent) -> StopEvent:
                receipt = charge(42)
                attempt(receipt)
                return StopEvent(result=(receipt, charge(42)))

    else:

        class W(Workflow):  # type: ignore[no-redef]
            @step(retry_policy=policy)
            async def checkout(self, ev: StartEvent) -> StopEvent:
                receipt = await acharge(42)
                attempt(receipt)
                return StopEvent(result=(receipt, await acharge(42)))

    assert await eli.run(W(timeout=10), gate=gate, run_id=run_id) == ("ch_42_1", "ch_42_2")
    assert runs == ["ch_42_1", "ch_42_1"]
    assert charged == [42, 42]


async def test_llamaindex_step_retry_policy_keeps_distinct_executions_apart(gate, run_id):
    """Two executions of a step with identical events are two effects, retry or not: the one
    that charged, then failed, is retried and reads its own receipt; the other charges once."""
    from workflows import Context, Workflow, step
    from workflows.events import Event, StartEvent, StopEvent
    from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

    import estop
    from estop.adapters import llamaindex as eli

    class Pay(Event):
        amount: int

    class Paid(Event):
        receipt: str

    charged: list[int] = []
    failed: list[str] = []

    @estop.effect(tool="charge")
    async def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{len(charged)}"

    class W(Workflow):
        @step
        async def plan(self, ctx: Context, ev: StartEvent) -> Pay | None:
            ctx.send_event(Pay(amount=5))
            ctx.send_event(Pay(amount=5))
            return None

        @step(num_workers=1, retry_policy=retry_policy(wait=wait_fixed(0.01), stop=stop_after_attempt(3)))
        async def pay(self, ev: Pay) -> Paid:
            receipt = await charge(ev.amount)
            if not failed:
                failed.append(receipt)
                raise ConnectionError("flaked after the charge")
            return Paid(receipt=receipt)

        @step
        async def join(self, ctx: Context, ev: Paid) -> StopEvent | None:
            got = ctx.collect_events(ev, [Paid, Paid])
            return None if got is None else StopEvent(result=sorted(e.receipt for e in got))

    assert await eli.run(W(timeout=10), gate=gate, run_id=run_id) == ["ch_1", "ch_2"]
    assert charged == [5, 5]


async def test_llamaindex_step_retry_policy_one_exception_object_for_two_executions(gate, run_id):
    """Two executions of a step that charged, then raised the same exception object (one the
    application keeps): each retry takes one failed attempt, never both the same one, so the two
    charges are two and neither retry charges again."""
    from workflows import Context, Workflow, step
    from workflows.events import Event, StartEvent, StopEvent
    from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

    import estop
    from estop.adapters import llamaindex as eli

    class Pay(Event):
        amount: int

    class Paid(Event):
        receipt: str

    flaked = ConnectionError("the shipping API flaked after the charge")
    charged: list[int] = []

    @estop.effect(tool="charge")
    async def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{len(charged)}"

    class W(Workflow):
        @step
        async def plan(self, ctx: Context, ev: StartEvent) -> Pay | None:
            ctx.send_event(Pay(amount=5))
            ctx.send_event(Pay(amount=5))
            return None

        @step(num_workers=2, retry_policy=retry_policy(wait=wait_fixed(0.01), stop=stop_after_attempt(3)))
        async def pay(self, ctx: Context, ev: Pay) -> Paid:
            receipt = await charge(ev.amount)
            if ctx.retry_info().retry_number == 0:
                raise flaked
            return Paid(receipt=receipt)

        @step
        async def join(self, ctx: Context, ev: Paid) -> StopEvent | None:
            got = ctx.collect_events(ev, [Paid, Paid])
            return None if got is None else StopEvent(result=sorted(e.receipt for e in got))

    assert await eli.run(W(timeout=10), gate=gate, run_id=run_id) == ["ch_1", "ch_2"]
    assert charged == [5, 5]


async def test_llamaindex_wait_for_event_rerun_reuses_the_key(gate, run_id):
    """A step that charges, then waits (`ctx.wait_for_event`), is run again from its start when
    the awaited event arrives (LlamaIndex replays it): the charge before the wait — a plain
    `estop.effect`, no `ctx=` — presents the same key on the replay and reads its receipt
    (without the link it was a second occurrence in the run: a new key, a second charge)."""
    from workflows import Context, Workflow, step
    from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

    import estop
    from estop.adapters import llamaindex as eli

    class Confirm(HumanResponseEvent):
        ok: bool

    charged: list[int] = []
    runs: list[str] = []

    @estop.effect(tool="charge")
    async def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{amount}_{len(charged)}"

    class W(Workflow):
        @step
        async def checkout(self, ctx: Context, ev: StartEvent) -> StopEvent:
            receipt = await charge(42)
            runs.append(receipt)
            got = await ctx.wait_for_event(Confirm, waiter_event=InputRequiredEvent(prefix="confirm?"), waiter_id="confirm")
            return StopEvent(result=(receipt, got.ok))

    h = eli.run(W(timeout=10), gate=gate, run_id=run_id)
    async for ev in h.stream_events():
        if isinstance(ev, InputRequiredEvent):
            h.ctx.send_event(Confirm(ok=True))
    assert await h == ("ch_42_1", True)
    assert runs == ["ch_42_1", "ch_42_1"]  # the step ran twice, the charge once
    assert charged == [42]


async def test_llamaindex_wait_for_event_reruns_keep_distinct_executions_apart(gate, run_id):
    """Two executions of a step with identical events each charge, then wait: each replay reads
    its own execution's receipt, so the two charges stay two (and neither replay charges)."""
    from workflows import Context, Workflow, step
    from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

    import estop
    from estop.adapters import llamaindex as eli

    class Pay(Event):
        amount: int

    class Paid(Event):
        receipt: str

    class Confirm(HumanResponseEvent):
        ok: bool

    charged: list[int] = []
    runs: list[str] = []

    @estop.effect(tool="charge")
    async def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{len(charged)}"

    class W(Workflow):
        @step
        async def plan(self, ctx: Context, ev: StartEvent) -> Pay | None:
            ctx.send_event(Pay(amount=5))
            ctx.send_event(Pay(amount=5))
            return None

        @step(num_workers=2)
        async def pay(self, ctx: Context, ev: Pay) -> Paid:
            receipt = await charge(ev.amount)
            runs.append(receipt)
            await ctx.wait_for_event(Confirm, waiter_event=InputRequiredEvent(prefix=receipt))
            return Paid(receipt=receipt)

        @step
        async def join(self, ctx: Context, ev: Paid) -> StopEvent | None:
            got = ctx.collect_events(ev, [Paid, Paid])
            return None if got is None else StopEvent(result=sorted(e.receipt for e in got))

    h = eli.run(W(timeout=10), gate=gate, run_id=run_id)
    asked = 0
    async for ev in h.stream_events():
        if isinstance(ev, InputRequiredEvent):
            asked += 1
            if asked == 2:  # both executions wait: one Confirm wakes both
                h.ctx.send_event(Confirm(ok=True))
    assert await h == ["ch_1", "ch_2"]
    assert sorted(runs) == ["ch_1", "ch_1", "ch_2", "ch_2"]
    assert charged == [5, 5]


def test_openai_agents_callable_needs_approval_and_refusal_output(gate, daemon, run_id):
    from agents import Agent, function_tool
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    async def big(ctx, params, call_id) -> bool:
        return params["amount"] > 100

    @function_tool(needs_approval=big)
    def refund(amount: int) -> str:
        """Refund."""
        return "refunded"

    model = ScriptedModel([
        ModelStep(output=[function_call("refund", {"amount": 5}, call_id="a"), function_call("refund", {"amount": 500}, call_id="b")]),
        ModelStep(output=[assistant_message("done")]),
    ])
    agent = Agent(name="a", model=model, tools=eo.gate_tools([refund]))

    def operator():
        p = wait_pending(daemon.operator, run_id)
        assert p["args"] == {"amount": 500}
        daemon.operator.reject(run_id, p["key"])

    th = threading.Thread(target=operator)

    async def go():
        r = await eo.run(agent, "go", gate=gate, run_id=run_id)
        # The big refund asks for approval; the small one of the same turn is held as its
        # sibling (whole-turn admission): both are the SDK's own pause.
        assert sorted(i.raw_item.call_id for i in r.interruptions) == ["a", "b"]
        state = r.to_state()
        th.start()
        decided = await eo.resolve(agent, state, gate=gate, run_id=run_id, timeout_s=10)
        # (the small one is `sibling` until the reject lifts the hold, then it may go: `approve`)
        small, big = (decided[k] for k in eo.holds(agent, sorted(r.interruptions, key=lambda i: i.raw_item.call_id), run_id))
        assert big == "reject" and small in ("sibling", "approve"), decided
        return await eo.run(agent, state, gate=gate, run_id=run_id)

    r = asyncio.run(go())
    th.join()
    outputs = [i.output for i in r.new_items if getattr(i, "type", "") == "tool_call_output_item"]
    assert "refunded" in outputs and any("rejected" in str(o) for o in outputs)


def test_reconnect_across_daemon_restart(run_id):
    """kill -9 the gate mid-session: the client reconnects, and receipts and fences survived."""
    with Daemon(policy=POLICY) as d:
        gate = d.gate(backoff_initial_s=0.05, reconnect_attempts=10)
        n = []

        @estop.effect
        def charge(amount: int) -> str:
            n.append(amount)
            return "ok"

        with gate.run(run_id):
            assert charge(1) == "ok"
        d.kill9()
        d.start()
        with gate.run(run_id):
            assert charge(1) == "ok"  # a receipt from before the crash: not run again
        assert n == [1]
        gate.close()


async def test_openai_agents_streamed_cancel_fences_threads(gate, daemon, run_id):
    from agents import Agent, function_tool
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    landed = []
    release = threading.Event()
    started = threading.Event()
    refused = []

    @estop.effect
    def charge(amount: int) -> str:
        landed.append(amount)
        return "ok"

    @function_tool
    def slow_refund(amount: int) -> str:
        """Slow refund in a worker thread."""
        started.set()
        release.wait(5)
        try:
            return charge(-amount)
        except estop.RunStopped as e:
            refused.append(e)
            return "stopped"

    model = ScriptedModel([ModelStep(output=[function_call("slow_refund", {"amount": 3}, call_id="a")]), ModelStep(output=[assistant_message("done")])])
    agent = Agent(name="a", model=model, tools=eo.gate_tools([slow_refund]))
    streamed = eo.run_streamed(agent, "go", gate=gate, run_id=run_id)
    async for ev in streamed.stream_events():
        if getattr(ev, "type", "") == "run_item_stream_event" and getattr(ev, "name", "") == "tool_called":
            await asyncio.to_thread(started.wait, 5)  # the tool thread is running now
            streamed.cancel()
            break
    release.set()
    for _ in range(200):
        if refused:
            break
        await asyncio.sleep(0.01)
    assert landed == [] and refused
    st = await asyncio.to_thread(daemon.operator.status, run_id)
    assert st["state"] in ("cancelled", "finalizing")


def test_langgraph_retry_policy_reuses_the_key(gate, daemon, run_id):
    """Regression (issue 18): the node's Step was cached in its config, so a RetryPolicy's second
    attempt got occurrence 2 and a new key (`…:charge:1:` then `…:charge:2:`): charged twice."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import RetryPolicy

    from estop.adapters import langgraph as el

    charged = []
    attempts = []

    @el.effect
    def charge(amount: int) -> str:
        charged.append(amount)
        return "ch_1"

    def checkout(state: S) -> dict:
        receipt = charge(42)
        attempts.append(receipt)
        if len(attempts) == 1:
            raise ConnectionError("the shipping API flaked after the charge")
        return {"log": [receipt]}

    g = StateGraph(S)
    g.add_node("checkout", checkout, retry_policy=RetryPolicy(max_attempts=3, initial_interval=0.01, jitter=False))
    g.add_edge(START, "checkout")
    g.add_edge("checkout", END)
    graph = el.EstopGraph(g.compile(checkpointer=InMemorySaver()), gate)
    out = graph.invoke({"log": []}, {"configurable": {"thread_id": run_id}})
    assert out["log"] == ["ch_1"] and attempts == ["ch_1", "ch_1"]
    assert charged == [42], "the retried node must reuse its key and read the receipt"
    rep = daemon.operator.report(run_id)
    assert len(rep["done"]) == 1, rep


@pytest.mark.parametrize("fails", ["after_the_charge", "before_the_charge"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_pydantic_ai_model_retry_reruns_a_failed_call_without_charging_twice(gate, run_id, fails, kind):
    """A tool raising `ModelRetry` (PydanticAI's own tool retry) makes the model call it again:
    the same arguments, a new call id. Before the fix the retry ran in its own step `call:c2`, so
    the charge the failed call had done was charged again. Now the retry runs in the failed
    call's step: a charge done before the failure is read back, one never reached is made."""
    from pydantic_ai import Agent, ModelRetry
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from estop.adapters import pydantic_ai as ep

    charged, runs, seen = [], [], []

    @estop.effect(tool="charge")
    def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{len(charged)}"

    def llm(messages, info):
        turn = sum(isinstance(m, ModelResponse) for m in messages)
        if turn < 2:
            return ModelResponse(parts=[ToolCallPart("checkout", {"amount": 42}, tool_call_id=f"c{turn + 1}")])
        seen.append(messages[-1].parts[-1].content)
        return ModelResponse(parts=[TextPart("done")])

    def body(amount: int) -> str:
        runs.append(amount)
        if fails == "before_the_charge" and len(runs) == 1:
            raise ModelRetry("the card API flaked before the charge")
        receipt = charge(amount)
        if fails == "after_the_charge" and len(runs) == 1:
            raise ModelRetry("the shipping API flaked after the charge")
        return receipt

    agent = Agent(FunctionModel(llm))
    if kind == "sync":
        @agent.tool_plain(retries=2)
        def checkout(amount: int) -> str:
            return body(amount)

    else:

        @agent.tool_plain(retries=2)
        async def checkout(amount: int) -> str:
            return await asyncio.to_thread(body, amount)

    ep.gate_agent(agent)
    r = asyncio.run(ep.run(agent, "check out", gate=gate, run_id=run_id))
    assert r.output == "done" and runs == [42, 42] and charged == [42] and seen == ["ch_1"]


def test_pydantic_ai_timed_out_thread_tool_is_unknown_then_settled(gate, daemon, run_id):
    """Regression (issue 18): `tool_plain(timeout=…)` on a sync tool: PydanticAI abandons the
    thread and tells the model to retry. The adapter recorded `error` although the thread went on
    and charged, and the model's retry got a new key and charged again (2 charges, report: failed).
    Now the timed-out call is `unknown`, its thread's completion settles it, and the retry of the
    same call reads that outcome instead of charging again."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from estop.adapters import pydantic_ai as ep

    charged = []
    finished = threading.Event()
    seen = {}

    def llm(messages, info):
        turn = sum(isinstance(m, ModelResponse) for m in messages)
        if turn == 0:
            return ModelResponse(parts=[ToolCallPart("charge", {"amount": 42}, tool_call_id="c1")])
        if turn == 1:  # the retry prompt came back: the model tries the same charge again
            finished.wait(5)  # (the abandoned thread has charged by now)
            seen["after_timeout"] = daemon.operator.report(run_id)
            return ModelResponse(parts=[ToolCallPart("charge", {"amount": 42}, tool_call_id="c2")])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(llm))

    @agent.tool_plain(timeout=0.05, retries=3)
    def charge(amount: int) -> str:
        try:
            time.sleep(0.3)  # a slow payment API
            charged.append(amount)
            return "ch_42"
        finally:
            finished.set()

    ep.gate_agent(agent)
    r = asyncio.run(ep.run(agent, "charge", gate=gate, run_id=run_id))
    assert r.output == "done"
    assert charged == [42], "the model's retry of the timed-out call charged again"
    rep = daemon.operator.report(run_id)
    assert rep["failed"] == [] and seen["after_timeout"]["failed"] == [], "a timed-out thread tool is never `error`"
    assert len(rep["done"]) == 1 and rep["unknown"] == [] and rep["in_flight"] == [], rep


def _oai_timed_out_charge(charged: list, finished: threading.Event):
    """An async tool past the SDK's own timeout (`@function_tool(timeout=…)`) whose blocking
    payment call runs in `asyncio.to_thread`: the timeout cancels the coroutine, not the thread,
    which charges 0.9 s later (amount 42 only; other amounts are quick). The timeout (0.3 s) also
    bounds the gate's round trips before the body: generous, so a loaded machine still times
    out inside the body."""
    from agents import function_tool

    def pay(amount: int) -> str:
        if amount == 42:
            time.sleep(0.9)  # a slow payment API
        charged.append(amount)
        if amount == 42:
            finished.set()
        return f"ch_{amount}"

    @function_tool(timeout=0.3)
    async def charge(amount: int) -> str:
        """Charge the customer."""
        return await asyncio.to_thread(pay, amount)

    return charge


def _oai_outputs(result) -> dict:
    def call_id(raw):
        return raw.get("call_id") if isinstance(raw, dict) else getattr(raw, "call_id", None)

    return {call_id(i.raw_item): i.output for i in result.new_items if getattr(i, "type", "") == "tool_call_output_item"}


def test_openai_agents_timed_out_tool_is_unknown_and_its_retry_is_not_a_new_effect(gate, daemon, run_id):
    """Regression (the Agents SDK timeout_retry leak): the SDK's tool timeout cancelled the tool
    coroutine and told the model (`error_as_result`); the thread charged; the model's retry (a new
    call id) was gated as a new effect and charged again. Now the timed-out call is `unknown`
    (never `error`), the retry with the same arguments takes its key and is refused in doubt
    (an output the model reads), other arguments are a new call, and once an operator settles the
    call a later retry gets the settled result, still without charging."""
    from agents import Agent
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    charged: list = []
    finished = threading.Event()
    tools = eo.gate_tools([_oai_timed_out_charge(charged, finished)])

    def step(cid, amount):
        return ModelStep(output=[function_call("charge", {"amount": amount}, call_id=cid)])

    done = ModelStep(output=[assistant_message("done")])
    agent = Agent(name="a", model=ScriptedModel([step("c1", 42), step("c2", 42), step("c3", 7), done]), tools=tools)
    out = _oai_outputs(asyncio.run(eo.run(agent, "charge", gate=gate, run_id=run_id)))
    assert finished.wait(5)
    assert "timed out" in out["c1"], out
    assert "may still have happened" in out["c2"] and "do not retry" in out["c2"], out
    assert out["c3"] == "ch_7", "other arguments are a new call"
    assert sorted(charged) == [7, 42], "the model's retry of the timed-out call charged again"
    rep = daemon.operator.report(run_id)
    assert rep["failed"] == [] and [e["tool"] for e in rep["unknown"]] == ["charge"], "a timed-out call is `unknown`, never `error`"
    assert len(rep["done"]) == 1 and rep["in_flight"] == [], rep

    # An operator finds the payment and settles the call: the next retry (a later turn of the
    # same run) reads that result instead of charging.
    key = rep["unknown"][0]["key"]
    daemon.operator.call("saga", run=run_id, key=key, action="settle", outcome="ok", result="ch_42")
    agent = Agent(name="a", model=ScriptedModel([step("c4", 42), done]), tools=tools)
    out = _oai_outputs(asyncio.run(eo.run(agent, "charge again", gate=gate, run_id=run_id)))
    assert out["c4"] == "ch_42", out
    assert sorted(charged) == [7, 42]
    rep = daemon.operator.report(run_id)
    assert len(rep["done"]) == 2 and rep["unknown"] == [], rep


def test_openai_agents_retry_of_a_timed_out_call_after_a_cancel_runs_nothing(gate, daemon, run_id):
    """After an operator's cancel of the run, the retry of a timed-out call still takes that
    call's key and asks the gate, which answers a known key from its record (the in-doubt
    outcome, as it answers any repeat with its receipt): nothing runs, and the next new effect
    of the run (other arguments) is refused (`RunStopped`). (Before the fix the retry itself was
    a new effect, refused by the stop.)"""
    from agents import Agent
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    charged: list = []
    finished = threading.Event()
    tools = eo.gate_tools([_oai_timed_out_charge(charged, finished)])

    def step(cid, amount):
        return ModelStep(output=[function_call("charge", {"amount": amount}, call_id=cid)])

    agent = Agent(name="a", model=ScriptedModel([step("c1", 42), ModelStep(output=[assistant_message("later")])]), tools=tools)
    asyncio.run(eo.run(agent, "charge", gate=gate, run_id=run_id))
    assert finished.wait(5) and charged == [42]
    daemon.operator.cancel(run_id, "stop everything")
    agent = Agent(name="a", model=ScriptedModel([step("c2", 42), step("c3", 7), ModelStep(output=[assistant_message("done")])]), tools=tools)
    with pytest.raises(estop.RunStopped) as stopped:
        asyncio.run(eo.run(agent, "charge again", gate=gate, run_id=run_id))
    assert charged == [42], "the retry ran after the cancel"
    # The retry was answered from the timed-out call's record; the new call c3 met the stop.
    assert (stopped.value.key or "").startswith("call:c3:"), stopped.value.key
    rep = daemon.operator.report(run_id)
    assert [e["tool"] for e in rep["unknown"]] == ["charge"] and rep["done"] == [] and rep["in_flight"] == [], rep


def test_openai_agents_operator_cancel_before_the_first_admission_is_run_stopped(gate, daemon, run_id):
    """Regression (issue 18): an operator's cancel of a run id before its first admission
    surfaced as the SDK's `UserError("Error running tool …")` instead of `RunStopped`."""
    from agents import Agent, function_tool
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    @function_tool
    def charge(amount: int) -> str:
        """Charge."""
        raise AssertionError("never runs")

    daemon.operator.cancel(run_id, "stopped before it started")
    model = ScriptedModel([ModelStep(output=[function_call("charge", {"amount": 1}, call_id="c1")]), ModelStep(output=[assistant_message("ok")])])
    with pytest.raises(estop.RunStopped):
        asyncio.run(eo.run(Agent(name="a", model=model, tools=eo.gate_tools([charge])), "go", gate=gate, run_id=run_id))
