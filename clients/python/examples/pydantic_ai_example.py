"""PydanticAI + estop: an approval tool decided by an estop operator; a rejection sticks even
when the model retries through another tool.   python examples/pydantic_ai_example.py [--human]"""

from __future__ import annotations

from _demo import gate, operator_decides
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from estop.adapters import pydantic_ai as ep

turns = [
    [ToolCallPart("wire_money", {"to": "acct-9", "amount": 100}, tool_call_id="c1")],
    [ToolCallPart("pay_invoice", {"to": "acct-9", "amount": 100}, tool_call_id="c2")],  # the model retries another way
]


def llm(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:  # a scripted model
    n = sum(isinstance(m, ModelResponse) for m in messages)
    if n < len(turns):
        return ModelResponse(parts=turns[n])
    return ModelResponse(parts=[TextPart(f"gave up: {messages[-1].parts[0].content}")])


agent = Agent(FunctionModel(llm))


@agent.tool_plain(requires_approval=True)
def wire_money(to: str, amount: int) -> str:
    print(f"  -> wired {amount} to {to}")
    return "wired"


@agent.tool_plain
def pay_invoice(to: str, amount: int) -> str:
    print(f"  -> paid {amount} to {to}")
    return "paid"


g, op = gate()
ep.gate_agent(agent, effects={"pay_invoice": "wire_money"})  # both move money: one effect at the gate
print("the transfer waits for an estop decision; the operator rejects it")
operator_decides(op, "pa-demo-1", "reject")
result = ep.run_sync(agent, "pay acct-9", gate=g, run_id="pa-demo-1")
print("   final:", result.output)
print("   (nothing was wired or paid: the rejection stuck to the call, whatever tool proposed it)")
