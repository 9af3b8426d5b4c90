"""LangChain `create_agent` through `estop.adapters.langchain`, driven by LangChain's own fake
chat model (no network), against the session's real gate."""

from __future__ import annotations

import threading

import pytest


from .test_effect import wait_pending

pytest.importorskip("langchain.agents", reason="pip install 'estop-agents[langchain]'")


def _model(turns):
    from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel

    class Scripted(FakeMessagesListChatModel):
        def bind_tools(self, tools, **kw):
            return self

    return Scripted(responses=turns)


def _agent(gate, turns, sent, **mw):
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver

    from estop.adapters import langchain as elc

    @tool
    def notify(to: str) -> str:
        """Tell someone."""
        sent.append(("email", to))
        return "sent"

    @tool
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        sent.append(("wire", amount))
        return "wired"

    graph = create_agent(_model(turns), tools=[notify, wire_money], middleware=[elc.EstopMiddleware(**mw)], checkpointer=InMemorySaver())
    return elc.EstopAgent(graph, gate)


def _turns():
    from langchain_core.messages import AIMessage

    return [
        AIMessage(content="", tool_calls=[
            {"name": "notify", "args": {"to": "ops@example.com"}, "id": "n1"},
            {"name": "wire_money", "args": {"to": "acct-9", "amount": 100}, "id": "w1"},
        ]),
        AIMessage(content="done"),
    ]


def test_langchain_hold_is_an_interrupt_holding_the_turn_until_the_operator_approves(gate, daemon, run_id):
    sent = []
    agent = _agent(gate, _turns(), sent)
    cfg = {"configurable": {"thread_id": run_id}}
    out = agent.invoke({"messages": [("user", "pay and tell")]}, cfg)
    assert "__interrupt__" in out and sent == [], "nothing of the turn ran while its approval was pending"
    v = out["__interrupt__"][0].value
    assert v["action_request"]["action"] in ("wire_money", "notify") and "estop approve" in v["description"]
    p = wait_pending(daemon.operator, run_id)
    assert p["tool"] == "wire_money"
    threading.Timer(0.2, daemon.operator.approve, args=(run_id, p["key"])).start()
    assert agent.wait_for_decision(cfg, timeout_s=10)
    for _ in range(3):  # one interrupt per resume at most (ToolNode surfaces the first)
        out = agent.resume(cfg)
        if "__interrupt__" not in out:
            break
    assert out["messages"][-1].content == "done"
    assert sorted(sent) == [("email", "ops@example.com"), ("wire", 100)], "each call ran exactly once"


def test_langchain_reject_is_the_tool_result_and_sticks(gate, daemon, run_id):
    sent = []
    agent = _agent(gate, _turns(), sent, on_hold="wait")
    cfg = {"configurable": {"thread_id": run_id}}

    def operator():
        daemon.operator.reject(run_id, wait_pending(daemon.operator, run_id)["key"])

    threading.Thread(target=operator).start()
    out = agent.invoke({"messages": [("user", "pay and tell")]}, cfg)
    assert out["messages"][-1].content == "done"
    assert sent == [("email", "ops@example.com")], "the rejected transfer never ran; its sibling ran after the decision"
    results = {m.tool_call_id: m.content for m in out["messages"] if getattr(m, "tool_call_id", None)}
    assert "rejected" in str(results["w1"])



@pytest.mark.parametrize("order", ["estop_first", "retry_first"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tool_retry_middleware_does_not_charge_twice(gate, run_id, order, mode):
    """LangChain's `ToolRetryMiddleware` re-runs a tool that charged (an `estop.effect`), then
    failed. Listed after `EstopMiddleware` (inside its gated call) it calls ToolNode's execute
    again within the one call: before the fix both runs shared the step `call:c1`, so the second
    charge was a second occurrence (a new key) and charged again. Now each run is a fresh step:
    the retry's charge reads the first one's receipt and the retry completes. Listed before
    (outside), the retry is the same gated call again: the gate gives the recorded failure
    (`EffectFailed`), nothing runs again, and the middleware ends the call as an error."""
    import asyncio

    from langchain.agents import create_agent
    from langchain.agents.middleware import ToolRetryMiddleware
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver

    import estop
    from estop.adapters import langchain as elc

    charged: list[int] = []
    runs: list[str] = []

    @estop.effect(tool="charge")
    def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{amount}"

    def body(amount: int) -> str:
        receipt = charge(amount)
        runs.append(receipt)
        if len(runs) == 1:
            raise ConnectionError("the shipping API flaked after the charge")
        return receipt

    if mode == "sync":

        @tool
        def checkout(amount: int) -> str:
            """Charge, then ship."""
            return body(amount)

    else:

        @tool
        async def checkout(amount: int) -> str:
            """Charge, then ship."""
            return body(amount)

    retry = ToolRetryMiddleware(max_retries=2, initial_delay=0.01, jitter=False)
    gate_mw = elc.EstopMiddleware()
    mw = [gate_mw, retry] if order == "estop_first" else [retry, gate_mw]
    turns = [AIMessage(content="", tool_calls=[{"name": "checkout", "args": {"amount": 42}, "id": "c1"}]), AIMessage(content="done")]
    agent = elc.EstopAgent(create_agent(_model(turns), tools=[checkout], middleware=mw, checkpointer=InMemorySaver()), gate)
    cfg = {"configurable": {"thread_id": run_id}}
    out = agent.invoke({"messages": [("user", "check out")]}, cfg) if mode == "sync" else asyncio.run(agent.ainvoke({"messages": [("user", "check out")]}, cfg))
    assert charged == [42]
    tool_msg = [m for m in out["messages"] if getattr(m, "tool_call_id", None) == "c1"][-1]
    if order == "estop_first":
        assert runs == ["ch_42", "ch_42"] and tool_msg.status == "success", "the retry ran and read the charge's receipt"
    else:
        assert runs == ["ch_42"] and tool_msg.status == "error" and "failed before" in str(tool_msg.content)
