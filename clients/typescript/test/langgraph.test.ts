// LangGraph.js through the adapter, against a real `estop serve`: a StateGraph driven by a
// scripted chat model (a BaseChatModel of its own), tools in `toolNode`, effects in `gateNode`,
// a MemorySaver checkpointer, thread = run.
import assert from "node:assert/strict";
import { once } from "node:events";
import { test } from "node:test";
import { AIMessage, HumanMessage, ToolMessage, type BaseMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { END, MemorySaver, MessagesAnnotation, START, StateGraph } from "@langchain/langgraph";
import { z } from "zod";
import { Aborted, RunStopped } from "../src/index.js";
import { awaitDecision, gateNode, invoke, pendingHolds, resume, stream, toolNode, type LcTool } from "../src/adapters/langgraph.js";
import { ScriptedChatModel } from "./lc-helpers.js";
import { daemonPerFile, runId } from "./helpers.js";

const daemon = daemonPerFile();

function agentGraph(tools: LcTool[], script: Array<AIMessage | ((m: BaseMessage[]) => AIMessage)>) {
  const model = new ScriptedChatModel(script);
  const gate = daemon.get().gate();
  const app = new StateGraph(MessagesAnnotation)
    .addNode("agent", async (s: typeof MessagesAnnotation.State) => ({ messages: [await model.invoke(s.messages)] }))
    .addNode("tools", toolNode(gate, tools))
    .addEdge(START, "agent")
    .addConditionalEdges("agent", (s: typeof MessagesAnnotation.State) => ((s.messages.at(-1) as AIMessage).tool_calls?.length ? "tools" : END))
    .addEdge("tools", "agent")
    .compile({ checkpointer: new MemorySaver() });
  return { gate, app };
}

const call = (id: string, name: string, args: Record<string, unknown>) => ({ id, name, args, type: "tool_call" as const });

test("a hold is interrupt(); the operator approves; resume runs it exactly once, the sibling after it", async () => {
  const n = { wire_money: 0, send_email: 0 };
  const wire = tool(async ({ amount }: { amount: number }) => (n.wire_money++, `sent ${amount}`), { name: "wire_money", description: "move money", schema: z.object({ amount: z.number() }) });
  const email = tool(async ({ to }: { to: string }) => (n.send_email++, `emailed ${to}`), { name: "send_email", description: "send mail", schema: z.object({ to: z.string() }) });
  const { gate, app } = agentGraph([wire, email], [
    new AIMessage({ content: "", tool_calls: [call("c1", "wire_money", { amount: 5 }), call("c2", "send_email", { to: "ops" })] }),
    new AIMessage("done"),
  ]);
  const config = { configurable: { thread_id: runId("lg") } };
  await invoke(gate, app, { messages: [new HumanMessage("pay and tell ops")] }, config);
  const holds = await pendingHolds(app, config);
  assert.ok(holds.length >= 1, "paused on an estop hold");
  const approval = holds.find((h) => h.estop.reason === "approval");
  assert.ok(approval);
  assert.equal(approval.estop.key, "call:wire_money:c1");
  assert.deepEqual(approval.action_request, { action: "wire_money", args: { amount: 5 } });
  assert.deepEqual([n.wire_money, n.send_email], [0, 0], "nothing ran while the approval was pending (the sibling neither)");
  await daemon.get().operator.approve(config.configurable.thread_id, approval.estop.key);
  assert.equal(await awaitDecision(gate, approval), "decided");
  let out = (await resume(gate, app, config)) as typeof MessagesAnnotation.State;
  for (let i = 0; i < 3 && (await pendingHolds(app, config)).length; i++) out = (await resume(gate, app, config)) as typeof MessagesAnnotation.State;
  assert.equal(out.messages.at(-1)?.content, "done");
  assert.deepEqual([n.wire_money, n.send_email], [1, 1]);
  await resume(gate, app, config).catch(() => undefined); // a second resume changes nothing
  assert.deepEqual([n.wire_money, n.send_email], [1, 1]);
});

test("a rejection goes back to the model as the tool's output; the function never runs", async () => {
  const n = { wire_money: 0, send_email: 0 };
  const wire = tool(async () => (n.wire_money++, "sent"), { name: "wire_money", description: "move money", schema: z.object({ amount: z.number() }) });
  const { gate, app } = agentGraph([wire], [
    new AIMessage({ content: "", tool_calls: [call("r1", "wire_money", { amount: 100 })] }),
    (m) => new AIMessage(`model saw: ${String((m.at(-1) as ToolMessage).content)}`),
  ]);
  const config = { configurable: { thread_id: runId("lg") } };
  await invoke(gate, app, { messages: [new HumanMessage("pay")] }, config);
  const [hold] = await pendingHolds(app, config);
  assert.ok(hold);
  await daemon.get().operator.reject(config.configurable.thread_id, hold.estop.key);
  await awaitDecision(gate, hold);
  const out = (await resume(gate, app, config)) as typeof MessagesAnnotation.State;
  assert.match(String(out.messages.at(-1)?.content), /model saw: estop refused wire_money: rejected/);
  assert.equal(n.wire_money, 0);
});

test("a RetryPolicy retry of a gated node presents the same keys: charged once", async () => {
  const gate = daemon.get().gate();
  let charged = 0;
  let attempts = 0;
  const charge = gate.effect(async ({ amount }: { amount: number }) => (charged += amount), { tool: "charge" });
  const app = new StateGraph(MessagesAnnotation)
    .addNode("bill", gateNode(gate, "bill", async () => {
      await charge({ amount: 3 });
      if (attempts++ === 0) throw new Error("transient: the ledger API timed out after the charge");
      return { messages: [new AIMessage("billed")] };
    }), { retryPolicy: { maxAttempts: 3, initialInterval: 1, jitter: false, retryOn: () => true, logWarning: false } })
    .addEdge(START, "bill")
    .addEdge("bill", END)
    .compile({ checkpointer: new MemorySaver() });
  const config = { configurable: { thread_id: runId("lg") } };
  await invoke(gate, app, { messages: [] }, config);
  assert.equal(attempts, 2);
  assert.equal(charged, 3);
  const rep = await daemon.get().operator.report(config.configurable.thread_id);
  assert.equal((rep.done as unknown[]).length, 1);
});

test("interrupt is not cancel: aborting the invocation leaves the thread's run usable", async () => {
  const n = { send_email: 0 };
  const started = { slow: 0 };
  const slow = tool(async (_: { q: string }, config) => {
    started.slow++;
    await once(config.signal!, "abort");
    throw config.signal!.reason;
  }, { name: "slow_search", description: "slow", schema: z.object({ q: z.string() }) });
  const email = tool(async () => (n.send_email++, "ok"), { name: "send_email", description: "mail", schema: z.object({ to: z.string() }) });
  const { gate, app } = agentGraph([slow, email], [
    new AIMessage({ content: "", tool_calls: [call("s1", "slow_search", { q: "x" })] }),
    new AIMessage({ content: "", tool_calls: [call("e1", "send_email", { to: "a" })] }),
    new AIMessage("done"),
  ]);
  const thread = runId("lg");
  const ac = new AbortController();
  const p = invoke(gate, app, { messages: [new HumanMessage("go")] }, { configurable: { thread_id: thread }, signal: ac.signal });
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
  while (!started.slow) await new Promise((r) => setImmediate(r));
  ac.abort(new Error("user closed the tab"));
  await assert.rejects(p, Aborted);
  assert.equal((await daemon.get().operator.status(thread)).state, "active");
  // The same thread goes on: a new turn admits and runs.
  const { gate: g2, app: app2 } = agentGraph([email], [new AIMessage({ content: "", tool_calls: [call("e2", "send_email", { to: "b" })] }), new AIMessage("done")]);
  await invoke(g2, app2, { messages: [new HumanMessage("again")] }, { configurable: { thread_id: thread } });
  assert.equal(n.send_email, 1);
});

test("an operator cancel aborts the tool in flight and the graph: RunStopped", async () => {
  const started = { slow: 0 };
  const slow = tool(async (_: { q: string }, config) => {
    started.slow++;
    await once(config.signal!, "abort");
    throw config.signal!.reason;
  }, { name: "slow_upload", description: "slow", schema: z.object({ q: z.string() }) });
  const { gate, app } = agentGraph([slow], [new AIMessage({ content: "", tool_calls: [call("u1", "slow_upload", { q: "x" })] }), new AIMessage("done")]);
  const thread = runId("lg");
  const p = invoke(gate, app, { messages: [new HumanMessage("go")] }, { configurable: { thread_id: thread } });
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
  while (!started.slow) await new Promise((r) => setImmediate(r));
  await daemon.get().operator.cancel(thread, "operator stop");
  await assert.rejects(p, RunStopped);
  const rep = await daemon.get().operator.report(thread);
  assert.deepEqual((rep.unknown as Array<{ tool: string }>).map((e) => e.tool), ["slow_upload"]);
});

test("breaking out of a stream early is an interrupt: the thread's run goes on", async () => {
  const n = { send_email: 0 };
  const email = tool(async () => (n.send_email++, "ok"), { name: "send_email", description: "mail", schema: z.object({ to: z.string() }) });
  // The model answers the last message: a request to mail → the call; a tool result → done.
  const { gate, app } = agentGraph([email], [(m) => {
    const last = m.at(-1)!;
    if (last.getType() !== "human") return new AIMessage("done");
    const to = String(last.content).endsWith("a") ? "a" : "b";
    return new AIMessage({ content: "", tool_calls: [call(`e-${to}`, "send_email", { to })] });
  }]);
  const config = { configurable: { thread_id: runId("lg") } };
  let chunks = 0;
  for await (const _ of stream(gate, app, { messages: [new HumanMessage("mail a")] }, config)) {
    if (++chunks === 2) break; // the agent's turn, then its tools: the user has seen enough
  }
  assert.equal(n.send_email, 1);
  assert.equal((await daemon.get().operator.status(config.configurable.thread_id)).state, "active");
  await invoke(gate, app, { messages: [new HumanMessage("and b")] }, config);
  assert.equal(n.send_email, 2);
});
