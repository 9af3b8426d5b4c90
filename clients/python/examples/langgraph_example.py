"""LangGraph + estop: a parallel sibling waits while a transfer awaits approval; a rerun node
does not charge twice.   python examples/langgraph_example.py [--human]"""

from __future__ import annotations

import operator
from typing import Annotated, TypedDict

from _demo import gate, operator_decides
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from estop.adapters import langgraph as el


@el.effect(tool="wire_money")  # the policy says: needs approval
def wire_money(to: str, amount: int) -> str:
    print(f"  -> wired {amount} to {to}")
    return "wired"


@el.effect
def send_email(to: str, body: str) -> str:
    print(f"  -> emailed {to}: {body}")
    return "sent"


class S(TypedDict):
    log: Annotated[list, operator.add]


def pay(state: S) -> dict:
    return {"log": [wire_money("acct-9", 100)]}  # held → interrupt(); the operator decides in estop


def notify(state: S) -> dict:
    return {"log": [send_email("ops@example.com", "paying acct-9")]}  # a sibling: held too


@el.effect
def charge(customer: str, amount: int) -> str:
    print(f"  -> charged {customer} {amount}")
    return f"ch_{customer}_{amount}"


def checkout(state: S) -> dict:
    receipt = charge("cus_1", 42)  # on resume the node re-runs: estop returns this receipt
    interrupt({"confirm shipping for": receipt})  # LangGraph re-runs the whole node on resume
    return {"log": [receipt]}


g = StateGraph(S)
for name, fn in [("pay", pay), ("notify", notify)]:
    g.add_node(name, fn)
    g.add_edge(START, name)
    g.add_edge(name, END)
agent_gate, op = gate()
graph = el.EstopGraph(g.compile(checkpointer=InMemorySaver()), agent_gate)
config = {"configurable": {"thread_id": "lg-demo-1"}}

print("1. invoke: the transfer needs approval; the email is a sibling and waits too")
out = graph.invoke({"log": []}, config)
print("   interrupted with:", [i.value["estop"]["reason"] for i in out["__interrupt__"]])
operator_decides(op, "lg-demo-1", "approve").join()
print("2. resume after the operator approved in estop")
print("   state:", graph.resume(config)["log"])

print("3. a node that charges, then asks to confirm: LangGraph re-runs it on resume")
g2 = StateGraph(S)
g2.add_node("checkout", checkout)
g2.add_edge(START, "checkout")
g2.add_edge("checkout", END)
shop = el.EstopGraph(g2.compile(checkpointer=InMemorySaver()), agent_gate)
config2 = {"configurable": {"thread_id": "lg-demo-2"}}
shop.invoke({"log": []}, config2)
print("   resumed:", shop.resume(config2, True)["log"], "(one charge above, not two)")
