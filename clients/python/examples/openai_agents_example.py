"""OpenAI Agents SDK + estop: `needs_approval` is the SDK's own interruption, decided by an estop
operator; the saved RunState resumes exactly once.   python examples/openai_agents_example.py [--human]"""

from __future__ import annotations

import asyncio

from _demo import gate, operator_decides
from agents import Agent, RunState, function_tool
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

from estop.adapters import openai_agents as eo


@function_tool(needs_approval=True)
def wire_money(to: str, amount: int) -> str:
    """Wire money to an account."""
    print(f"  -> wired {amount} to {to}")
    return "wired"


@function_tool
def send_email(to: str, body: str) -> str:
    """Send an email."""
    print(f"  -> emailed {to}: {body}")
    return "sent"


def model() -> ScriptedModel:  # stands in for an LLM: one turn with two parallel tool calls
    return ScriptedModel([
        ModelStep(output=[function_call("wire_money", {"to": "acct-9", "amount": 100}, call_id="c1"),
                          function_call("send_email", {"to": "ops@example.com", "body": "paying acct-9"}, call_id="c2")]),
        ModelStep(output=[assistant_message("paid and told ops")]),
    ])


async def main() -> None:
    g, op = gate()
    tools = eo.gate_tools([wire_money, send_email])
    agent = Agent(name="ops", model=model(), tools=tools)
    print("1. run: the transfer is held for an estop approval, the email (a sibling) with it")
    r = await eo.run(agent, "pay acct-9", gate=g, run_id="oa-demo-1")
    print("   interruptions:", [i.tool_name for i in r.interruptions])
    saved = r.to_state().to_string()  # a pause you can keep across a restart
    print("2. the operator decides in estop; the app waits for it and resumes the saved state")
    operator_decides(op, "oa-demo-1", "approve")
    state = await RunState.from_string(agent, saved)
    print("   decisions:", await eo.resolve(agent, state, gate=g, run_id="oa-demo-1"))
    r = await eo.run(agent, state, gate=g, run_id="oa-demo-1")
    print("   final:", r.final_output)
    print("3. the same saved state resumed again (a redelivered job): receipts, nothing runs again")
    agent = Agent(name="ops", model=model(), tools=tools)
    state = await RunState.from_string(agent, saved)
    await eo.resolve(agent, state, gate=g, run_id="oa-demo-1")
    r = await eo.run(agent, state, gate=g, run_id="oa-demo-1")


asyncio.run(main())
