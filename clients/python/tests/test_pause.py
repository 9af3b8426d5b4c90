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
