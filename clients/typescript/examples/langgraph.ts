// LangGraph.js with estop in a minute: a ReAct-style graph whose refund needs an operator's
// approval. The hold is LangGraph's own interrupt(); the operator decides in estop (here this
// script plays the operator; a person would run `estop approve RUN KEY`).
// Run: npm run build && node dist/examples/langgraph.js
import { BaseChatModel } from "@langchain/core/language_models/chat_models";
import { AIMessage, HumanMessage } from "@langchain/core/messages";
import type { ChatResult } from "@langchain/core/outputs";
import { tool } from "@langchain/core/tools";
import { END, MemorySaver, MessagesAnnotation, START, StateGraph } from "@langchain/langgraph";
import { z } from "zod";
import { awaitDecision, invoke, pendingHolds, resume, toolNode } from "../src/adapters/langgraph.js";
import { Daemon } from "../src/testing.js";

/** Stands in for your chat model: asks for the refund, then answers. */
class Scripted extends BaseChatModel {
  private n = 0;
  _llmType() {
    return "scripted";
  }
  async _generate(): Promise<ChatResult> {
    const message = this.n++ === 0 ? new AIMessage({ content: "", tool_calls: [{ id: "call_1", name: "wire_money", args: { to: "acct-9", amount: 1999 }, type: "tool_call" }] }) : new AIMessage("Refund sent.");
    return { generations: [{ text: "", message }] };
  }
}

const daemon = await Daemon.start(); // `estop serve` on a temp dir; wire_money needs approval
const gate = daemon.gate();
const wire = tool(async ({ to, amount }) => `sent ${amount} to ${to}`, { name: "wire_money", description: "wire money", schema: z.object({ to: z.string(), amount: z.number() }) });
const model = new Scripted({});
const app = new StateGraph(MessagesAnnotation)
  .addNode("agent", async (s: typeof MessagesAnnotation.State) => ({ messages: [await model.invoke(s.messages)] }))
  .addNode("tools", toolNode(gate, [wire]))
  .addEdge(START, "agent")
  .addConditionalEdges("agent", (s: typeof MessagesAnnotation.State) => ((s.messages.at(-1) as AIMessage).tool_calls?.length ? "tools" : END))
  .addEdge("tools", "agent")
  .compile({ checkpointer: new MemorySaver() });

const config = { configurable: { thread_id: `order-${Date.now()}` } }; // thread = estop run
await invoke(gate, app, { messages: [new HumanMessage("refund order 42")] }, config);
for (const hold of await pendingHolds(app, config)) {
  console.log("paused:", hold.description);
  await daemon.operator.approve(hold.estop.run, hold.estop.key); // the operator, in estop
  await awaitDecision(gate, hold);
  const out = (await resume(gate, app, config)) as typeof MessagesAnnotation.State;
  console.log("answer:", out.messages.at(-1)?.content);
}
await daemon.stop();
