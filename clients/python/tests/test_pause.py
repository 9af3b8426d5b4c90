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
