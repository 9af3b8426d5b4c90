"""Each framework's native pause as the hold surface (issue 18); the decision is always an estop
operator's (G7)."""

from __future__ import annotations

import asyncio
import operator
import threading
import time
from typing import Annotated, TypedDict

import pytest

import estop

from .test_effect import wait_pending


class S(TypedDict):
    log: Annotated[list, operator.add]


def _wire_graph(gate, wired, approver=None):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph

    from estop.adapters import langgraph as el

    @el.effect(tool="wire_money", approver=approver)
    def wire_money(to: str, amount: int) -> str:
        wired.append(amount)
        return "wired"

    g = StateGraph(S)
    g.add_node("pay", lambda s: {"log": [wire_money("acct-9", 100)]})
    g.add_edge(START, "pay")
    g.add_edge("pay", END)
    return el.EstopGraph(g.compile(checkpointer=InMemorySaver()), gate)


def test_langgraph_hold_is_a_human_interrupt_and_the_decision_wakes_the_app(gate, daemon, run_id):
    """Old: the payload was `{"estop": {...}}` only (no HumanInterrupt shape for inbox UIs), and
    nothing told the application when the operator decided (it had to poll)."""
    wired = []
    graph = _wire_graph(gate, wired)
    cfg = {"configurable": {"thread_id": run_id}}
    out = graph.invoke({"log": []}, cfg)
    (intr,) = out["__interrupt__"]
    v = intr.value
    assert v["action_request"] == {"action": "wire_money", "args": {"to": "acct-9", "amount": 100}}
    assert v["config"] == {"allow_ignore": True, "allow_respond": False, "allow_edit": False, "allow_accept": True}
    assert "estop approve" in v["description"] and v["estop"]["reason"] == "approval"

    def operator():
        time.sleep(0.2)
        daemon.operator.approve(run_id, v["estop"]["key"])

    asked = []
    real_wait = gate.client.wait
    gate.client.wait = lambda *a: (asked.append(a), real_wait(*a))[1]  # count the gate asks
    th = threading.Thread(target=operator)
    th.start()
    assert graph.wait_for_decision(cfg, timeout_s=10) == {v["estop"]["key"]: "approve"}
    th.join()
    del gate.client.wait
    assert len(asked) == 1 and asked[0][2] == 0, "one look at subscribe time, then the event: no polling"
    assert graph.resume(cfg)["log"] == ["wired"] and wired == [100]
    # Decided before anyone waits: answered at once, from the gate (no event will come).
    assert graph.wait_for_decision(cfg, timeout_s=0.5) == {}


def test_langgraph_wait_for_decision_sees_a_decision_made_before_it(gate, daemon, run_id):
    wired = []
    graph = _wire_graph(gate, wired)
    cfg = {"configurable": {"thread_id": run_id}}
    out = graph.invoke({"log": []}, cfg)
    key = out["__interrupt__"][0].value["estop"]["key"]
    daemon.operator.reject(run_id, key)
    assert graph.wait_for_decision(cfg, timeout_s=5) == {key: "reject"}
    with pytest.raises(estop.Rejected):
        graph.resume(cfg)
    assert wired == []


def test_langgraph_inbox_accept_counts_only_through_an_operator(gate, daemon, run_id):
    """An agent-inbox HumanResponse `accept` is recorded as the operator's decision only when
    the UI holds an operator client (`approver=`); without one it is ignored (G7)."""
    from langgraph.types import Command

    wired = []
    graph = _wire_graph(gate, wired)  # no approver: the resume value cannot approve
    cfg = {"configurable": {"thread_id": run_id}}
    out = graph.invoke({"log": []}, cfg)
    intr = out["__interrupt__"][0]
    out = graph.invoke(Command(resume={intr.id: [{"type": "accept", "args": None}]}), cfg)
    assert "__interrupt__" in out and wired == []  # still held: nobody with authority decided

    wired2 = []
    run2 = run_id + "-ui"
    graph2 = _wire_graph(gate, wired2, approver=daemon.operator)
    cfg2 = {"configurable": {"thread_id": run2}}
    intr2 = graph2.invoke({"log": []}, cfg2)["__interrupt__"][0]
    out2 = graph2.invoke(Command(resume={intr2.id: [{"type": "accept", "args": None}]}), cfg2)
    assert out2["log"] == ["wired"] and wired2 == [100]


def _oai_agent(charged, steps):
    from agents import Agent, function_tool
    from agents.testing import ScriptedModel

    from estop.adapters import openai_agents as eo

    @function_tool(needs_approval=True)
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        charged.append(amount)
        return "wired"

    return Agent(name="ops", model=ScriptedModel(steps), tools=eo.gate_tools([wire_money]))


def test_openai_agents_hold_is_a_native_interruption_that_survives_a_restart(daemon, run_id):
    """Old: the adapter blocked inside the tool call until the operator decided (a restart lost
    the pause). Now the run ends with the SDK's own `interruptions`; its RunState, saved and
    loaded by a new process, resumes exactly once after the estop decision."""
    from agents import RunState
    from agents.testing import ModelStep, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    steps = lambda: [ModelStep(output=[function_call("wire_money", {"to": "acct-9", "amount": 100}, call_id="w1")]), ModelStep(output=[assistant_message("done")])]
    charged = []
    gate1 = daemon.gate()
    r = asyncio.run(eo.run(_oai_agent(charged, steps()), "pay", gate=gate1, run_id=run_id))
    assert [i.tool_name for i in r.interruptions] == ["wire_money"] and charged == []
    saved = r.to_state().to_string()
    p = wait_pending(daemon.operator, run_id)  # the approval is in estop's inbox
    assert p["tool"] == "wire_money"
    gate1.close()

    # A new process: a fresh agent and gate client; the operator decides meanwhile.
    gate2 = daemon.gate()
    agent2 = _oai_agent(charged, steps()[1:])
    state = asyncio.run(RunState.from_string(agent2, saved))
    assert eo.holds(agent2, state.get_interruptions(), run_id) == [p["key"]]
    threading.Timer(0.2, daemon.operator.approve, args=(run_id, p["key"])).start()
    assert asyncio.run(eo.resolve(agent2, state, gate=gate2, run_id=run_id, timeout_s=10)) == {p["key"]: "approve"}
    r2 = asyncio.run(eo.run(agent2, state, gate=gate2, run_id=run_id))
    assert r2.final_output == "done" and charged == [100]
    # The same saved state resumed again (a redelivered job): the receipt, not a second transfer.
    agent3 = _oai_agent(charged, steps()[1:])
    state3 = asyncio.run(RunState.from_string(agent3, saved))
    asyncio.run(eo.resolve(agent3, state3, gate=gate2, run_id=run_id, timeout_s=10))
    r3 = asyncio.run(eo.run(agent3, state3, gate=gate2, run_id=run_id))
    assert r3.final_output == "done" and charged == [100]
    gate2.close()


def test_openai_agents_agent_side_approval_is_not_trusted(gate, daemon, run_id):
    """`state.approve(item)` in the agent process does not let the call run: it waits for the
    operator's decision at the gate (here a rejection)."""
    from agents.testing import ModelStep, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    charged = []
    steps = [ModelStep(output=[function_call("wire_money", {"to": "acct-9", "amount": 100}, call_id="w1")]), ModelStep(output=[assistant_message("done")])]
    agent = _oai_agent(charged, steps)
    r = asyncio.run(eo.run(agent, "pay", gate=gate, run_id=run_id))
    state = r.to_state()
    for item in state.get_interruptions():
        state.approve(item)  # the agent approves itself
    threading.Timer(0.3, lambda: daemon.operator.reject(run_id, wait_pending(daemon.operator, run_id)["key"])).start()
    r2 = asyncio.run(eo.run(agent, state, gate=gate, run_id=run_id))
    assert charged == []
    outputs = [i.output for i in r2.new_items if getattr(i, "type", "") == "tool_call_output_item"]
    assert any("rejected" in str(o) for o in outputs), outputs


def _pyd_agent(ran, *, again=False):
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.toolsets import FunctionToolset

    from estop.adapters import pydantic_ai as ep

    def llm(messages, info):
        n = sum(isinstance(m, ModelResponse) for m in messages)
        if n == 0:
            return ModelResponse(parts=[ToolCallPart("wire_money", {"to": "a", "amount": 9}, tool_call_id="d1")])
        if n == 1 and again:  # the model re-plans: the same transfer through a second call
            return ModelResponse(parts=[ToolCallPart("wire_money", {"to": "a", "amount": 9}, tool_call_id="d2")])
        return ModelResponse(parts=[TextPart("ok")])

    def wire_money(to: str, amount: int) -> str:
        ran.append(amount)
        return "wired"

    toolset = ep.EstopToolset(FunctionToolset([wire_money]), on_hold="defer")
    return Agent(FunctionModel(llm), toolsets=[toolset], output_type=[str, DeferredToolRequests])


def test_pydantic_ai_native_deny_is_an_estop_reject_only_through_an_operator(gate, daemon, run_id):
    """Old: `on_hold="defer"` ignored a native deny (the estop approval stayed pending, and the
    same transfer asked again later was held again instead of refused)."""
    from pydantic_ai import DeferredToolRequests, DeferredToolResults, ToolDenied

    from estop.adapters import pydantic_ai as ep

    ran = []
    agent = _pyd_agent(ran, again=True)
    r = asyncio.run(ep.run(agent, "pay", gate=gate, run_id=run_id))
    assert isinstance(r.output, DeferredToolRequests)
    key = r.output.metadata["d1"]["estop"]["key"]
    # An agent-side deny without an operator credential: nothing is decided at the gate.
    denied = DeferredToolResults(approvals={"d1": ToolDenied("no")})
    asyncio.run(ep.run(_pyd_agent(ran), gate=gate, run_id=run_id, message_history=r.all_messages(), deferred_tool_results=denied))
    assert [p["key"] for p in daemon.operator.pending(run_id)] == [key]
    # The approval UI holds an operator client: the native deny is that operator's reject.
    r2 = asyncio.run(ep.run(agent, gate=gate, run_id=run_id, message_history=r.all_messages(), deferred_tool_results=denied, approver=daemon.operator))
    assert daemon.operator.pending(run_id) == []
    # The model re-plans the same transfer (call d2): refused for the rest of the run (G2).
    assert r2.output == "ok" and ran == []
    outputs = [p.content for m in r2.all_messages() for p in getattr(m, "parts", []) if getattr(p, "tool_call_id", None) == "d2" and hasattr(p, "content")]
    assert any("rejected" in str(o) for o in outputs), outputs


def test_pydantic_ai_native_approve_without_operator_is_deferred_again(gate, daemon, run_id):
    from pydantic_ai import DeferredToolRequests, DeferredToolResults

    from estop.adapters import pydantic_ai as ep

    ran = []
    r = asyncio.run(ep.run(_pyd_agent(ran), "pay", gate=gate, run_id=run_id))
    ok = DeferredToolResults(approvals={"d1": True})
    r2 = asyncio.run(ep.run(_pyd_agent(ran), gate=gate, run_id=run_id, message_history=r.all_messages(), deferred_tool_results=ok))
    assert isinstance(r2.output, DeferredToolRequests) and ran == []  # still held: not trusted
    key = r.output.metadata["d1"]["estop"]["key"]
    threading.Timer(0.2, daemon.operator.approve, args=(run_id, key)).start()
    assert asyncio.run(gate.await_decided(run_id, [key], timeout_s=10)) == {key: "approve"}
    r3 = asyncio.run(ep.run(_pyd_agent(ran), gate=gate, run_id=run_id, message_history=r.all_messages(), deferred_tool_results=ok))
    assert r3.output == "ok" and ran == [9]


def _maf_agent(charged, steps, *, slow_first=None):
    from agent_framework import Agent, FunctionMiddleware, tool

    from estop.adapters import agent_framework as eaf

    from .scenarios.maf import ScriptedChatClient

    @tool(approval_mode="always_require")
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        charged.append(("wire", amount))
        return "wired"

    @tool
    def notify(to: str) -> str:
        """Tell someone."""
        charged.append(("email", to))
        return "sent"

    class Slow(FunctionMiddleware):
        """Another middleware before estop's that takes a while for one tool (validation, a
        lookup): the calls of the turn reach estop's middleware in a different order."""

        async def process(self, context, call_next):
            if context.function.name == slow_first:
                await asyncio.sleep(0.3)
            await call_next()

    mw = eaf.middleware()
    return Agent(client=ScriptedChatClient(steps), tools=eaf.gate_tools([wire_money, notify]), middleware=[mw[0], Slow(), mw[1]])


def test_agent_framework_hold_is_a_native_approval_request_that_survives_a_restart(daemon, run_id):
    """Old: the middleware blocked inside the function call until the operator decided (a
    restart lost the pause). Now the response carries the framework's own
    `function_approval_request` (`user_input_requests`); saved with the session and loaded by a
    new process, it resumes exactly once after the estop decision."""
    import json

    from agent_framework import AgentSession, Content, Message

    from estop.adapters import agent_framework as eaf

    from .scenarios.maf import call

    steps = lambda: [[call("wire_money", "w1", to="acct-9", amount=100)], [Content.from_text("done")]]
    charged = []
    gate1 = daemon.gate()
    agent = _maf_agent(charged, steps())
    session = agent.create_session()
    r = asyncio.run(eaf.run(agent, "pay", gate=gate1, run_id=run_id, session=session))
    (req,) = r.user_input_requests
    assert req.type == "function_approval_request" and charged == []
    p = wait_pending(daemon.operator, run_id)  # the approval is in estop's inbox
    assert eaf.holds([req]) == [p["key"]] and req.additional_properties["estop"]["reason"] == "approval"
    saved = json.dumps({"session": session.to_dict(), "requests": [q.to_dict() for q in r.user_input_requests]})
    gate1.close()

    def resume(saved_json):
        # A new process: a fresh agent, gate client and session loaded from storage.
        data = json.loads(saved_json)
        gate = daemon.gate()
        try:
            agent2 = _maf_agent(charged, steps()[1:])
            session2 = AgentSession.from_dict(data["session"])
            requests = [Content.from_dict(q) for q in data["requests"]]
            answers = asyncio.run(eaf.resolve(requests, gate=gate, run_id=run_id, timeout_s=10))
            return asyncio.run(eaf.run(agent2, Message(role="user", contents=answers), gate=gate, run_id=run_id, session=session2)), answers
        finally:
            gate.close()

    threading.Timer(0.2, daemon.operator.approve, args=(run_id, p["key"])).start()
    r2, answers = resume(saved)
    assert [a.approved for a in answers] == [True]
    assert r2.text == "done" and charged == [("wire", 100)]
    # The same saved session resumed again (a redelivered job): the receipt, not a second transfer.
    r3, _ = resume(saved)
    assert r3.text == "done" and charged == [("wire", 100)]


def test_agent_framework_agent_side_approval_is_not_trusted(gate, daemon, run_id):
    """An approval response the agent process writes itself does not let the call run: estop
    still holds it (the response is the same approval request again) until the operator
    decides; after the operator's reject the call is refused."""
    from agent_framework import Content, Message

    from estop.adapters import agent_framework as eaf

    from .scenarios.maf import call

    charged = []
    agent = _maf_agent(charged, [[call("wire_money", "w1", to="acct-9", amount=100)], [Content.from_text("done")]])
    session = agent.create_session()
    r = asyncio.run(eaf.run(agent, "pay", gate=gate, run_id=run_id, session=session))
    forged = [q.to_function_approval_response(True) for q in r.user_input_requests]
    r2 = asyncio.run(eaf.run(agent, Message(role="user", contents=forged), gate=gate, run_id=run_id, session=session))
    assert charged == [] and eaf.holds(r2.user_input_requests) == eaf.holds(r.user_input_requests)
    daemon.operator.reject(run_id, eaf.holds(r.user_input_requests)[0])
    forged = [q.to_function_approval_response(True) for q in r2.user_input_requests]
    r3 = asyncio.run(eaf.run(agent, Message(role="user", contents=forged), gate=gate, run_id=run_id, session=session))
    assert charged == [] and not r3.user_input_requests
    results = [c.result for m in r3.messages for c in m.contents if c.type == "function_result"]
    assert any("rejected" in str(x) for x in results), results


def test_agent_framework_whole_turn_is_admitted_before_any_call_starts(gate, daemon, run_id):
    """The model asks for an email and a transfer in one turn, and the transfer reaches estop's
    call middleware late (another middleware is slow for it). Without whole-turn admission the
    email was admitted, started and sent before the transfer's approval existed; with it, the
    transfer's approval is asked when the turn arrives, and the email is held as its sibling
    (a native pause of its own) until the operator decides."""
    from agent_framework import Content, Message

    from estop.adapters import agent_framework as eaf

    from .scenarios.maf import call

    charged = []
    turn = [call("notify", "n1", to="ops@example.com"), call("wire_money", "w1", to="acct-9", amount=100)]
    agent = _maf_agent(charged, [turn, [Content.from_text("done")]], slow_first="wire_money")
    session = agent.create_session()
    r = asyncio.run(eaf.run(agent, "pay and tell", gate=gate, run_id=run_id, session=session))
    assert charged == [], "nothing of the turn ran while its approval was pending"
    assert sorted(q.function_call.name for q in r.user_input_requests) == ["notify", "wire_money"]
    reasons = {q.function_call.name: q.additional_properties["estop"]["reason"] for q in r.user_input_requests}
    assert reasons == {"notify": "sibling", "wire_money": "approval"}
    threading.Timer(0.2, daemon.operator.reject, args=(run_id, wait_pending(daemon.operator, run_id)["key"])).start()
    answers = asyncio.run(eaf.resolve(r.user_input_requests, gate=gate, run_id=run_id, timeout_s=10))
    assert {a.function_call.name: a.approved for a in answers} == {"notify": True, "wire_money": False}
    asyncio.run(eaf.run(agent, Message(role="user", contents=answers), gate=gate, run_id=run_id, session=session))
    assert charged == [("email", "ops@example.com")]


def _li_workflow(wired):
    from workflows import Context, Workflow, step
    from workflows.events import StartEvent, StopEvent

    from estop.adapters import llamaindex as eli

    @eli.effect(tool="wire_money")
    async def wire(to: str, amount: int, ctx: Context | None = None) -> str:
        wired.append(amount)
        return "wired"

    class Pay(Workflow):
        @step
        async def go(self, ctx: Context, ev: StartEvent) -> StopEvent:
            return StopEvent(result=await wire("acct-9", 3, ctx=ctx))

    return Pay


@pytest.mark.parametrize("decided", ["while_saved", "after_restore"])
async def test_llamaindex_hold_is_a_native_pause_released_by_estop(gate, daemon, run_id, decided):
    """Old: the held step blocked inside the gate's wait (`EstopHeld` was only announced), so a
    `HumanResponseEvent` did nothing and LlamaIndex's documented pause (save the context, cancel,
    restore) lost the held call. Now the step waits with `wait_for_event`: the workflow is idle,
    its context is saved while held, the application's own response releases nothing, and the
    operator's approval — given while no process runs the workflow — releases the restored
    workflow, whose effect runs once."""
    from workflows import Context
    from workflows.events import HumanResponseEvent

    from estop.adapters import llamaindex as eli

    wired = []
    Pay = _li_workflow(wired)
    h = eli.run(Pay(timeout=8), gate=gate, run_id=run_id)
    held = None
    async for ev in h.stream_events():
        if isinstance(ev, eli.EstopHeld):
            held = ev.estop
            break
    assert held is not None and held["reason"] == "approval" and wired == []
    h.ctx.send_event(HumanResponseEvent(response="yes, approved"))  # the agent side: decides nothing
    # Wait for the workflow to be idle with only the held step waiting: nothing runs it.
    saved = None
    for _ in range(200):
        saved = h.ctx.to_dict()
        if h.ctx.is_running and wired == [] and "estop:" in str(saved):
            break
        await asyncio.sleep(0.01)
    assert wired == [] and [p["key"] for p in daemon.operator.pending(run_id)] == [held["key"]]
    await h.cancel_run()  # LlamaIndex's pause: the context is saved, the process may go
    if decided == "while_saved":
        await asyncio.to_thread(daemon.operator.approve, run_id, held["key"])

    h2 = eli.run(Pay(timeout=8), gate=gate, run_id=run_id, ctx=Context.from_dict(Pay(), saved))
    if decided == "after_restore":
        await asyncio.sleep(0.3)
        assert wired == [], "the restored step is still held"
        await asyncio.to_thread(daemon.operator.approve, run_id, held["key"])
    assert await h2 == "wired" and wired == [3]


async def test_llamaindex_reject_releases_the_step_with_a_refusal(gate, daemon, run_id):
    import estop
    from estop.adapters import llamaindex as eli

    wired = []
    h = eli.run(_li_workflow(wired)(timeout=30), gate=gate, run_id=run_id)
    async for ev in h.stream_events():
        if isinstance(ev, eli.EstopHeld):
            await asyncio.to_thread(daemon.operator.reject, run_id, ev.estop["key"])
    with pytest.raises(estop.Rejected):
        await h
    assert wired == []


def _pyd_llm():
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    def llm(messages, info):
        if sum(isinstance(m, ModelResponse) for m in messages) == 0:
            return ModelResponse(parts=[ToolCallPart("wire_money", {"to": "a", "amount": 9}, tool_call_id="d1"), ToolCallPart("lookup", {"q": "x"}, tool_call_id="l1")])
        return ModelResponse(parts=[TextPart("ok")])

    return FunctionModel(llm)


def _pyd_capability_agent(ran, output_type):
    from pydantic_ai import Agent
    from pydantic_ai.toolsets import FunctionToolset

    from estop.adapters import pydantic_ai as ep

    def lookup(q: str) -> str:
        ran.append(("lookup", q))
        return "found"

    agent = Agent(_pyd_llm(), toolsets=[FunctionToolset([lookup])], output_type=output_type, capabilities=[ep.EstopCapability()])

    @agent.tool_plain(requires_approval=True)
    def wire_money(to: str, amount: int) -> str:
        ran.append(("wire", amount))
        return "wired"

    return agent


async def test_pydantic_ai_capability_gates_agent_and_toolset_tools_and_defers_natively(gate, daemon, run_id):
    """`Agent(capabilities=[ep.EstopCapability()])` gates the agent's own tools and its toolsets'
    through PydanticAI's public hook (no private attribute is touched), and with the agent able
    to return `DeferredToolRequests` the default hold is PydanticAI's deferral. Old: no
    capability, `gate_agent` patched `agent._function_toolset`, and the default hold blocked."""
    from pydantic_ai import DeferredToolRequests, DeferredToolResults

    from estop.adapters import pydantic_ai as ep

    ran = []
    agent = _pyd_capability_agent(ran, [str, DeferredToolRequests])
    r = await asyncio.wait_for(ep.run(agent, "pay", gate=gate, run_id=run_id), 10)
    assert isinstance(r.output, DeferredToolRequests) and ran == [("lookup", "x")]
    key = r.output.metadata["d1"]["estop"]["key"]
    assert [p["key"] for p in daemon.operator.pending(run_id)] == [key]
    assert "get_tools" not in vars(agent._function_toolset), "a private attribute was patched"
    await asyncio.to_thread(daemon.operator.approve, run_id, key)
    r2 = await ep.run(agent, gate=gate, run_id=run_id, message_history=r.all_messages(), deferred_tool_results=DeferredToolResults(approvals={"d1": True}))
    assert r2.output == "ok" and ran == [("lookup", "x"), ("wire", 9)]
    rep = daemon.operator.report(run_id)
    assert len(rep["done"]) == 2, rep  # both tools went through the gate


async def test_pydantic_ai_agent_that_cannot_defer_waits_for_the_operator(gate, daemon, run_id):
    """`on_hold="auto"` with an agent whose output type has no `DeferredToolRequests`: the held
    call waits for the operator (PydanticAI could not defer it)."""
    ran = []
    agent = _pyd_capability_agent(ran, str)

    async def operator():
        p = await asyncio.to_thread(wait_pending, daemon.operator, run_id)
        await asyncio.to_thread(daemon.operator.approve, run_id, p["key"])

    from estop.adapters import pydantic_ai as ep

    decide = asyncio.ensure_future(operator())
    r = await asyncio.wait_for(ep.run(agent, "pay", gate=gate, run_id=run_id), 10)
    await decide
    assert r.output == "ok" and sorted(ran) == [("lookup", "x"), ("wire", 9)]


async def test_pydantic_ai_gate_agent_uses_the_public_per_run_capability(gate, daemon, run_id):
    from pydantic_ai import Agent

    from estop.adapters import pydantic_ai as ep

    ran = []
    agent = Agent(_pyd_llm())

    @agent.tool_plain
    def wire_money(to: str, amount: int) -> str:
        ran.append(amount)
        return "wired"

    @agent.tool_plain
    def lookup(q: str) -> str:
        return "found"

    ep.gate_agent(agent, on_hold="wait")
    assert "get_tools" not in vars(agent._function_toolset)

    async def operator():
        p = await asyncio.to_thread(wait_pending, daemon.operator, run_id)
        await asyncio.to_thread(daemon.operator.reject, run_id, p["key"])

    decide = asyncio.ensure_future(operator())
    r = await asyncio.wait_for(ep.run(agent, "pay", gate=gate, run_id=run_id), 10)
    await decide
    assert r.output == "ok" and ran == []  # wire_money is an approval by the gate's policy, rejected


def _oai_refunder(refunded, steps, *, before=None):
    from agents import Agent, function_tool
    from agents.testing import ScriptedModel

    @function_tool
    def lookup(order: str) -> str:
        """Look the order up."""
        if before is not None:
            before()
        return "order found"

    @function_tool
    def refund(amount: int) -> str:
        """Refund."""
        refunded.append(amount)
        return "refunded"

    return Agent(name="billing", model=ScriptedModel(steps), tools=[lookup, refund])


def test_openai_agents_handoff_acts_in_a_child_run_and_a_parent_cancel_reaches_it(gate, daemon, run_id):
    """`eo.gate_agent(triage)` gates the agents it hands off to as well: the billing agent's calls
    act in the child run `RUN.billing` (parent link at the gate), so an operator's cancel of the
    conversation's run stops the billing agent's next call. Old: a handed-off agent's tools were
    not gated at all unless wrapped one by one."""
    from agents import Agent
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    refunded = []
    billing = _oai_refunder(refunded, [
        ModelStep(output=[function_call("lookup", {"order": "42"}, call_id="l1")]),
        ModelStep(output=[function_call("refund", {"amount": 5}, call_id="r1")]),
        ModelStep(output=[assistant_message("refunded")]),
    ], before=lambda: daemon.operator.cancel(run_id, "the customer hung up"))
    triage = Agent(name="triage", model=ScriptedModel([ModelStep(output=[function_call("transfer_to_billing", {}, call_id="h1")])]), handoffs=[billing])
    with pytest.raises(estop.RunStopped):
        asyncio.run(eo.run(eo.gate_agent(triage), "refund order 42", gate=gate, run_id=run_id))
    assert refunded == [], "the cancel of the parent run reached the handed-off agent"
    child = daemon.operator.status(f"{run_id}.billing")
    assert child["parent"] == run_id and child["state"] == "cancelled", child


def test_openai_agents_agent_tool_is_a_child_run(gate, daemon, run_id):
    from agents import Agent
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    refunded = []
    billing = _oai_refunder(refunded, [ModelStep(output=[function_call("refund", {"amount": 5}, call_id="r1")]), ModelStep(output=[assistant_message("done")])])
    main = Agent(name="ops", model=ScriptedModel([
        ModelStep(output=[function_call("ask_billing", {"input": "refund 5"}, call_id="a1")]),
        ModelStep(output=[assistant_message("all done")]),
    ]), tools=[eo.agent_tool(billing, "ask_billing", "Ask billing")])
    r = asyncio.run(eo.run(main, "refund", gate=gate, run_id=run_id))
    assert r.final_output == "all done" and refunded == [5]
    child = daemon.operator.status(f"{run_id}.ask_billing-a1")
    assert child["parent"] == run_id, child
    assert len(daemon.operator.report(f"{run_id}.ask_billing-a1")["done"]) == 1


def test_langgraph_whole_turn_is_admitted_before_any_call_starts(gate, daemon, run_id):
    """ToolNode runs a turn's calls in parallel; here the transfer reaches estop's wrapper late
    (another wrapper is slow for it). Without whole-turn admission the email was admitted,
    started and sent before the transfer's approval existed; with it, the transfer's approval is
    asked with the turn, the email is held as its sibling (an interrupt) and nothing is sent."""
    import time as _time

    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from estop.adapters import langgraph as el

    sent = []

    @tool
    def notify(to: str) -> str:
        """Tell someone."""
        sent.append(to)
        return "sent"

    @tool
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        sent.append(f"wire {amount}")
        return "wired"

    wrap, _ = el.gate_tool_calls(approval={"wire_money"})

    def slow_then_estop(request, execute):
        if request.tool_call["name"] == "wire_money":
            _time.sleep(0.3)  # another interceptor (validation, a lookup) takes a while
        return wrap(request, execute)

    g = StateGraph(MessagesState)
    g.add_node("tools", ToolNode([notify, wire_money], wrap_tool_call=slow_then_estop))
    g.add_edge(START, "tools")
    graph = el.EstopGraph(g.compile(checkpointer=InMemorySaver()), gate)
    turn = AIMessage(content="", tool_calls=[
        {"name": "notify", "args": {"to": "ops@example.com"}, "id": "n1"},
        {"name": "wire_money", "args": {"to": "acct-9", "amount": 100}, "id": "w1"},
    ])
    out = graph.invoke({"messages": [turn]}, {"configurable": {"thread_id": run_id}})
    assert sent == [], "nothing of the turn ran while its approval was pending"
    held = {i.value["estop"]["tool"]: i.value["estop"]["reason"] for i in out["__interrupt__"]}
    assert held.get("notify") == "sibling", held  # (ToolNode may surface only the first interrupt)
    assert [p["tool"] for p in daemon.operator.pending(run_id)] == ["wire_money"]


async def test_pydantic_ai_whole_turn_is_admitted_before_any_call_starts(gate, daemon, run_id):
    """The same for PydanticAI: another capability delays the transfer; the email is deferred
    with it instead of being sent before the approval existed."""
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from estop.adapters import pydantic_ai as ep

    sent = []

    def llm(messages, info):
        if sum(isinstance(m, ModelResponse) for m in messages) == 0:
            return ModelResponse(parts=[ToolCallPart("notify", {"to": "ops"}, tool_call_id="n1"), ToolCallPart("wire_money", {"to": "a", "amount": 9}, tool_call_id="w1")])
        return ModelResponse(parts=[TextPart("ok")])

    class Slow(AbstractCapability):
        async def wrap_tool_execute(self, ctx, *, call, tool_def, args, handler):
            if call.tool_name == "wire_money":
                await asyncio.sleep(0.3)
            return await handler(args)

    agent = Agent(FunctionModel(llm), output_type=[str, DeferredToolRequests], capabilities=[Slow(), ep.EstopCapability()])

    @agent.tool_plain
    def notify(to: str) -> str:
        sent.append(to)
        return "sent"

    @agent.tool_plain(requires_approval=True)
    def wire_money(to: str, amount: int) -> str:
        sent.append(amount)
        return "wired"

    r = await asyncio.wait_for(ep.run(agent, "pay and tell", gate=gate, run_id=run_id), 10)
    assert sent == [], "nothing of the turn ran while its approval was pending"
    assert isinstance(r.output, DeferredToolRequests)
    assert r.output.metadata["n1"]["estop"]["reason"] == "sibling"
    # The transfer's approval was asked with the turn (PydanticAI may defer the delayed call
    # itself once the email deferred, before it reaches the gate).
    assert [p["tool"] for p in daemon.operator.pending(run_id)] == ["wire_money"]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_whole_turn_is_admitted_before_any_call_starts(gate, daemon, run_id, streamed):
    """The Agents SDK asks each call's `needs_approval` in the call's own task; here the
    transfer's own `needs_approval` callable takes a while (a lookup), so the email's task reaches
    the gate first. Without whole-turn admission the email was admitted, started and sent before
    the transfer's approval existed; with it (the run's `on_llm_end` hook sees the model response
    before any tool runs) the transfer's approval is asked with the turn, the email is held as its
    sibling (an interruption of its own) and nothing is sent."""
    from agents import Agent, function_tool
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    sent = []

    @function_tool
    def notify(to: str) -> str:
        """Tell someone."""
        sent.append(to)
        return "sent"

    async def slow_policy(ctx, params, call_id) -> bool:
        await asyncio.sleep(0.3)  # the application's own approval rule looks something up
        return True

    @function_tool(needs_approval=slow_policy)
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        sent.append(f"wire {amount}")
        return "wired"

    turn = [function_call("notify", {"to": "ops"}, call_id="n1"), function_call("wire_money", {"to": "acct-9", "amount": 100}, call_id="w1")]
    agent = Agent(name="ops", model=ScriptedModel([ModelStep(output=turn), ModelStep(output=[assistant_message("done")])]), tools=eo.gate_tools([notify, wire_money]))

    async def first():
        if not streamed:
            return await eo.run(agent, "pay and tell", gate=gate, run_id=run_id)
        st = eo.run_streamed(agent, "pay and tell", gate=gate, run_id=run_id)
        async for _ in st.stream_events():
            pass
        return st.result

    r = asyncio.run(first())
    assert sent == [], "nothing of the turn ran while its approval was pending"
    assert sorted(i.tool_name for i in r.interruptions) == ["notify", "wire_money"]
    assert [p["tool"] for p in daemon.operator.pending(run_id)] == ["wire_money"]
    # The operator approves: both calls of the turn run once on resume.
    state = r.to_state()
    threading.Timer(0.2, lambda: daemon.operator.approve(run_id, wait_pending(daemon.operator, run_id)["key"])).start()
    asyncio.run(eo.resolve(agent, state, gate=gate, run_id=run_id, timeout_s=10))
    r2 = asyncio.run(eo.run(agent, state, gate=gate, run_id=run_id))
    assert r2.final_output == "done" and sorted(sent) == ["ops", "wire 100"]
