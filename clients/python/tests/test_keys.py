"""Keys from the framework's own call identity (issue 18). Before, a tool call's key was the run's
invocation + tool + digest + order, so the same charge asked in two turns of one conversation
(two invocations of the run) got the same key: the second turn's charge returned the first's
receipt and never happened."""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, TypedDict

import pytest


def _keys(daemon, run_id):
    return sorted(e["key"] for e in daemon.operator.report(run_id)["done"])


def test_openai_agents_two_turns_same_call_both_charge(gate, daemon, run_id):
    from agents import Agent, function_tool
    from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

    from estop.adapters import openai_agents as eo

    charged = []

    @function_tool
    def charge(amount: int) -> str:
        """Charge."""
        charged.append(amount)
        return f"ch_{len(charged)}"

    for cid in ("call_turn1", "call_turn2"):
        model = ScriptedModel([ModelStep(output=[function_call("charge", {"amount": 5}, call_id=cid)]), ModelStep(output=[assistant_message("ok")])])
        asyncio.run(eo.run(Agent(name="a", model=model, tools=eo.gate_tools([charge])), "charge 5", gate=gate, run_id=run_id))
    assert charged == [5, 5]
    keys = _keys(daemon, run_id)
    assert [k.split(":")[:2] for k in keys] == [["call", "call_turn1"], ["call", "call_turn2"]], keys


def test_pydantic_ai_two_turns_same_call_both_charge_and_replay_reads_receipt(gate, daemon, run_id):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from estop.adapters import pydantic_ai as ep

    charged = []

    def agent_for(cid):
        def llm(messages, info):
            if sum(isinstance(m, ModelResponse) for m in messages) == 0:
                return ModelResponse(parts=[ToolCallPart("charge", {"amount": 5}, tool_call_id=cid)])
            return ModelResponse(parts=[TextPart("ok")])

        agent = Agent(FunctionModel(llm))

        @agent.tool_plain
        def charge(amount: int) -> str:
            charged.append(amount)
            return f"ch_{len(charged)}"

        return ep.gate_agent(agent)

    for cid in ("t1", "t2", "t1"):  # the third is turn 1 replayed (a redelivered job)
        asyncio.run(ep.run(agent_for(cid), "charge 5", gate=gate, run_id=run_id))
    assert charged == [5, 5]
    assert len(_keys(daemon, run_id)) == 2


def test_agent_framework_two_turns_same_call_both_charge(gate, daemon, run_id):
    from agent_framework import Agent, tool

    from estop.adapters import agent_framework as eaf

    from .scenarios.maf import ScriptedChatClient, call

    charged = []

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        charged.append(amount)
        return f"ch_{len(charged)}"

    for cid in ("m1", "m2"):
        agent = Agent(client=ScriptedChatClient([[call("charge", cid, amount=5)]]), tools=[charge], middleware=[eaf.EstopMiddleware()])
        asyncio.run(eaf.run(agent, "charge 5", gate=gate, run_id=run_id))
    assert charged == [5, 5]


class MS(TypedDict):
    messages: Annotated[list, operator.add]


def test_langgraph_tool_node_keys_by_tool_call_id_and_resume_reads_receipts(gate, daemon, run_id):
    """Two identical calls of one AIMessage are two effects; the tools node, re-run after one of
    them failed, reads the other's receipt instead of charging again."""
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph

    from estop.adapters import langgraph as el

    charged = []
    flaky = [True]

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        charged.append(amount)
        return f"ch_{len(charged)}"

    @tool
    def ship(order: str) -> str:
        """Ship."""
        if flaky and flaky.pop():
            raise ConnectionError("the carrier API is down")
        return "shipped"

    def agent(state):
        return {"messages": [AIMessage("", tool_calls=[
            {"name": "charge", "args": {"amount": 5}, "id": "tc_a"},
            {"name": "charge", "args": {"amount": 5}, "id": "tc_b"},
            {"name": "ship", "args": {"order": "o1"}, "id": "tc_c"},
        ])]}

    g = StateGraph(MS)
    g.add_node("agent", agent)
    g.add_node("tools", el.tool_node([charge, ship], skip={"ship"}, handle_tool_errors=False))
    g.add_edge(START, "agent")
    g.add_edge("agent", "tools")
    g.add_edge("tools", END)
    graph = el.EstopGraph(g.compile(checkpointer=InMemorySaver()), gate)
    cfg = {"configurable": {"thread_id": run_id}}
    with pytest.raises(ConnectionError):
        graph.invoke({"messages": []}, cfg)
    assert charged == [5, 5]
    out = graph.invoke(None, cfg)  # the tools node runs again (resume after the failure)
    assert charged == [5, 5], "the re-run tools node charged again"
    assert sorted(m.content for m in out["messages"][1:]) == ["ch_1", "ch_2", "shipped"]
    assert sorted(k.split(":")[1] for k in _keys(daemon, run_id)) == ["tc_a", "tc_b"]
