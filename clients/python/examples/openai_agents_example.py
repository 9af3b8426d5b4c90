"""OpenAI Agents SDK + estop: `needs_approval` decided by an estop operator, the sibling waits,
a redelivered job does not charge twice.   python examples/openai_agents_example.py [--human]"""

from __future__ import annotations

import asyncio

from _demo import gate, operator_decides
from agents import Agent, function_tool
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
    print("1. run: the transfer waits for an estop approval, the email (a sibling) waits with it")
    operator_decides(op, "oa-demo-1", "approve")
    r = await eo.run(Agent(name="ops", model=model(), tools=tools), "pay acct-9", gate=g, run_id="oa-demo-1")
    print("   final:", r.final_output)
    print("2. the job is redelivered (same run): both calls are receipts, nothing runs again")
    r = await eo.run(Agent(name="ops", model=model(), tools=tools), "pay acct-9", gate=g, run_id="oa-demo-1")
    print("   final:", r.final_output)


asyncio.run(main())
