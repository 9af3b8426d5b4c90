"""LlamaIndex Workflows + estop: `stop()` fences a step thread that LlamaIndex cannot stop.
   python examples/llamaindex_example.py"""

from __future__ import annotations

import asyncio
import time

from _demo import gate
from workflows import Workflow, step
from workflows.events import StartEvent, StopEvent

import estop
from estop.adapters import llamaindex as eli


@estop.effect
def refund(order: str, amount: int) -> str:
    print(f"  -> refunded {amount} on {order}")
    return "refunded"


class Refunds(Workflow):
    @step
    def work(self, ev: StartEvent) -> StopEvent:  # a sync step: LlamaIndex runs it in a thread
        refund("order-1", 10)
        time.sleep(1.0)  # a slow SDK call; the user presses stop meanwhile
        try:
            refund("order-2", 20)
        except estop.RunStopped as e:
            print(f"  -> not refunded: {e}")
        return StopEvent(result="done")


async def main() -> None:
    g, _ = gate()
    handler = eli.run(Refunds(timeout=30), gate=g, run_id="li-demo-1")
    await asyncio.sleep(0.5)
    print("stop: estop first (the run is fenced), then the workflow (cancel_run would only interrupt)")
    await handler.stop("user pressed stop")
    try:
        await handler
    except Exception as e:
        print("   workflow:", type(e).__name__)
    await asyncio.sleep(1.0)  # the step thread finishes its sleep, tries the second refund, is refused


asyncio.run(main())
