"""Microsoft Agent Framework + estop: the function middleware admits every tool call; a held call
is Agent Framework's own approval request, answered by the estop operator; a timed-out run
cannot land its effect from a worker thread afterwards.
   python examples/agent_framework_example.py [--human]"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from _demo import gate, operator_decides
from agent_framework import Agent, BaseChatClient, ChatResponse, Content, Message, tool
from agent_framework._middleware import ChatMiddlewareLayer
from agent_framework._tools import FunctionInvocationLayer

import estop
from estop.adapters import agent_framework as eaf


class Scripted(FunctionInvocationLayer, ChatMiddlewareLayer, BaseChatClient):
    """Stands in for a model: answers call i with steps[i]."""

    def __init__(self, steps: list[Any]) -> None:
        super().__init__()
        self.steps = steps

    async def _inner_get_response(self, *, messages: Any, stream: bool, options: Any, **kw: Any) -> ChatResponse:
        contents = self.steps.pop(0) if self.steps else [Content.from_text("done")]
        return ChatResponse(messages=[Message(role="assistant", contents=contents)], response_id="r")


@tool(approval_mode="always_require")
def wire_money(to: str, amount: int) -> str:
    """Wire money."""
    print(f"  -> wired {amount} to {to}")
    return "wired"


@estop.effect
def charge(customer: str, amount: int) -> str:
    print(f"  -> charged {customer} {amount}")
    return "charged"


def slow_charge(customer: str, amount: int) -> str:
    time.sleep(1.0)  # a blocking SDK call
    try:
        return charge(customer, amount)
    except (estop.RunStopped, estop.Interrupted) as e:
        print(f"  -> not charged: {e}")
        return "stopped"


@tool
async def bill(customer: str, amount: int) -> str:
    """Bill a customer (blocking SDK in a worker thread)."""
    return await asyncio.to_thread(slow_charge, customer, amount)


def call(name: str, cid: str, **args: Any) -> Content:
    return Content.from_function_call(call_id=cid, name=name, arguments=args)


async def main() -> None:
    g, op = gate()
    mw = eaf.middleware()
    print("1. approval_mode=always_require becomes an estop approval: the run pauses with an approval request")
    agent = Agent(client=Scripted([[call("wire_money", "c1", to="acct-9", amount=100)]]), tools=eaf.gate_tools([wire_money]), middleware=mw)
    session = agent.create_session()  # session.to_dict() saves the pause; it survives a restart
    response = await eaf.run(agent, "pay", gate=g, run_id="af-demo-1", session=session)
    print("    requests:", [r.function_call.name for r in response.user_input_requests])
    operator_decides(op, "af-demo-1", "approve")
    answers = await eaf.resolve(response.user_input_requests, gate=g, run_id="af-demo-1")
    response = await eaf.run(agent, Message(role="user", contents=answers), gate=g, run_id="af-demo-1", session=session)
    print("   ", response.text)
    print("2. a run that times out while its tool thread is still going")
    agent = Agent(client=Scripted([[call("bill", "c2", customer="cus_1", amount=42)]]), tools=[bill], middleware=mw)
    try:
        await eaf.run(agent, "bill", gate=g, run_id="af-demo-2", timeout_s=0.3)
    except (TimeoutError, asyncio.TimeoutError):
        print("   timed out; estop interrupted this invocation (its tool thread starts nothing more; the run goes on)")
    await asyncio.sleep(1.2)


asyncio.run(main())
