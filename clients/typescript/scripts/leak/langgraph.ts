// LangGraph.js: the failure classes without estop (ToolNode, the graph's own interrupt()) and
// through estop/langgraph (toolNode, gateNode, invoke), driven by a scripted chat model.
import { AIMessage, HumanMessage, type BaseMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { Command, END, MemorySaver, MessagesAnnotation, START, StateGraph, interrupt } from "@langchain/langgraph";
import { ToolNode } from "@langchain/langgraph/prebuilt";
import { setTimeout as sleep } from "node:timers/promises";
import { z } from "zod";
import { awaitDecision, cancel, gateNode, invoke, pendingHolds, resume, toolNode, type LcTool } from "../../src/adapters/langgraph.js";
import { ScriptedChatModel } from "../../test/lc-helpers.js";
import { expect, DECIDE_AFTER_MS, SIBLING_WORK_MS, TOOL_DELAY_MS, api, arm, blockFor, quietly, until, type Scenarios, type Trial } from "./common.js";

type S = typeof MessagesAnnotation.State;
const call = (id: string, name: string, args: Record<string, unknown>) => ({ id, name, args, type: "tool_call" as const });
const calls = (...c: Array<ReturnType<typeof call>>) => new AIMessage({ content: "", tool_calls: c });
const money = z.object({ to: z.string(), amount: z.number() });

function agentGraph(t: Trial, tools: LcTool[], script: Array<AIMessage | ((m: BaseMessage[]) => AIMessage)>) {
  const model = new ScriptedChatModel(script);
  return new StateGraph(MessagesAnnotation)
    .addNode("agent", async (s: S) => ({ messages: [await model.invoke(s.messages)] }))
    .addNode("tools", (t.guarded ? toolNode(t.gate, tools) : new ToolNode(tools as never)) as never)
    .addEdge(START, "agent")
    .addConditionalEdges("agent", (s: S) => ((s.messages.at(-1) as AIMessage).tool_calls?.length ? "tools" : END))
    .addEdge("tools", "agent")
    .compile({ checkpointer: new MemorySaver() });
}

type App = ReturnType<typeof agentGraph>;
const cfg = (t: Trial, signal?: AbortSignal) => ({ configurable: { thread_id: t.runId }, ...(signal ? { signal } : {}) });

/** Without estop the tool asks the human itself (interrupt); with it the gate holds the call. */
function wireTool(t: Trial): LcTool {
  return tool(async (args: { to: string; amount: number }) => {
    if (!t.guarded && interrupt({ action: "wire_money", args }) !== "approve") return "the human rejected it";
    t.world.do("wire"); // the tool call is the transfer
    return "wired";
  }, { name: "wire_money", description: "wire money", schema: money });
}

/** Runs a graph to its end, deciding each pause the framework's way or estop's. */
async function drive(t: Trial, app: App, input: S | Command, humanDecision: "approve" | "reject"): Promise<void> {
  if (!t.guarded) {
    await app.invoke(input as never, cfg(t));
    while ((await app.getState(cfg(t))).tasks.some((x) => x.interrupts.length)) {
      await sleep(DECIDE_AFTER_MS);
      t.world.mark("decided");
      await app.invoke(new Command({ resume: humanDecision }), cfg(t));
    }
    return;
  }
  await invoke(t.gate, app, input, cfg(t));
  for (let hold = (await pendingHolds(app, cfg(t)))[0]; hold; hold = (await pendingHolds(app, cfg(t)))[0]) {
    await awaitDecision(t.gate, hold);
    await resume(t.gate, app, cfg(t));
  }
}

async function sibling(t: Trial): Promise<number> {
  const fx = api(t);
  const notify = tool(async ({ to }: { to: string }) => {
    await sleep(SIBLING_WORK_MS);
    await quietly(fx.email({ to }));
    return "told";
  }, { name: "notify", description: "tell someone", schema: z.object({ to: z.string() }) });
  const app = agentGraph(t, [wireTool(t), notify], [calls(call("c1", "wire_money", { to: "acct-9", amount: 100 }), call("c2", "notify", { to: "ops" })), new AIMessage("done")]);
  const decided = t.guarded ? await arm(t, "wire_money", "reject") : undefined;
  await drive(t, app, { messages: [new HumanMessage("pay and tell ops")] }, "reject");
  await decided?.done;
  expect(t.world.count("email", { after: "decided" }) >= 1 || !t.guarded, "the sibling goes on once the decision is made");
  expect(t.world.count("email") >= 1, "the sibling sent its email");
  return t.world.count("email", { before: "decided" });
}

async function reject(t: Trial): Promise<number> {
  const fx = api(t);
  const payInvoice = tool(async (args: { to: string; amount: number }) => {
    await quietly(fx.transfer(args)); // moves money too; nobody flagged it for approval
    return "paid";
  }, { name: "pay_invoice", description: "pay an invoice", schema: money });
  const args = { to: "acct-9", amount: 100 };
  const app = agentGraph(t, [wireTool(t), payInvoice], [calls(call("c1", "wire_money", args)), calls(call("c2", "pay_invoice", args)), new AIMessage("done")]);
  const decided = t.guarded ? await arm(t, "wire_money", "reject") : undefined;
  await drive(t, app, { messages: [new HumanMessage("pay acct-9")] }, "reject");
  await decided?.done;
  expect(t.world.count("wire", { before: "decided" }) === 0, "the flagged transfer waited for the human");
  return t.world.count("wire", { after: "decided" });
}

/** A node that charges and then asks the human to confirm: LangGraph re-runs the whole node on resume. */
async function replay(t: Trial): Promise<number> {
  const fx = api(t);
  const bill = async () => {
    await fx.charge({ amount: 42 });
    interrupt("charged: send the receipt?");
    return { messages: [new AIMessage("billed")] };
  };
  const app = new StateGraph(MessagesAnnotation)
    .addNode("bill", t.guarded ? gateNode(t.gate, "bill", bill) : bill)
    .addEdge(START, "bill")
    .addEdge("bill", END)
    .compile({ checkpointer: new MemorySaver() });
  const run = (input: S | Command) => (t.guarded ? invoke(t.gate, app, input, cfg(t)) : app.invoke(input as never, cfg(t)));
  await run({ messages: [] });
  await run(new Command({ resume: "yes" }));
  expect(t.world.count("charge") >= 1, "the charge happened");
  return t.world.count("charge") - 1;
}

async function stopMidTool(t: Trial, body: (fx: ReturnType<typeof api>, pressed: Promise<void>) => Promise<void>): Promise<number> {
  const fx = api(t);
  let started = false;
  let done = false;
  let press = () => {};
  const pressed = new Promise<void>((r) => (press = r));
  const refund = tool(async () => {
    started = true;
    try {
      await body(fx, pressed);
    } finally {
      done = true;
    }
    return "refunded";
  }, { name: "refund", description: "refund", schema: z.object({ amount: z.number() }) });
  const app = agentGraph(t, [refund], [calls(call("c1", "refund", { amount: 42 })), new AIMessage("done")]);
  const ac = new AbortController();
  const p = t.guarded ? invoke(t.gate, app, { messages: [new HumanMessage("refund")] }, cfg(t)) : app.invoke({ messages: [new HumanMessage("refund")] }, cfg(t, ac.signal));
  p.catch(() => {});
  await until(() => started);
  t.world.mark("stopped");
  // The stop first (a cancel fences this process at once), then the tool goes on: its API
  // call outlasted the user's patience, so its write comes after the stop by construction.
  const stop = t.guarded ? cancel(t.gate, cfg(t), "user pressed stop") : ac.abort(new Error("user pressed stop"));
  press();
  await stop;
  await p.catch(() => undefined);
  await until(() => done);
  return t.world.count("refund", { after: "stopped" });
}

async function interruptContinue(t: Trial): Promise<number> {
  const fx = api(t);
  let started = false;
  const slow = tool(async (_: { q: string }, config) => {
    started = true;
    await new Promise((r) => config.signal?.addEventListener("abort", r, { once: true }));
    return "late";
  }, { name: "slow_search", description: "slow", schema: z.object({ q: z.string() }) });
  const email = tool(async ({ to }: { to: string }) => (await quietly(fx.email({ to })), "sent"), { name: "send_email_tool", description: "mail", schema: z.object({ to: z.string() }) });
  const app = agentGraph(t, [slow, email], [calls(call("s1", "slow_search", { q: "x" })), calls(call("e1", "send_email_tool", { to: "ops" })), new AIMessage("done")]);
  const ac = new AbortController();
  const first = t.guarded ? invoke(t.gate, app, { messages: [new HumanMessage("search")] }, cfg(t, ac.signal)) : app.invoke({ messages: [new HumanMessage("search")] }, cfg(t, ac.signal));
  first.catch(() => {});
  await until(() => started);
  ac.abort(new Error("the user interrupted"));
  await first.catch(() => undefined);
  const next = { messages: [new HumanMessage("then email ops")] };
  await (t.guarded ? invoke(t.gate, app, next, cfg(t)) : app.invoke(next, cfg(t))).catch(() => undefined);
  return t.world.count("email") === 1 ? 0 : 1;
}

export const scenarios: Scenarios = {
  sibling,
  reject,
  replay,
  cancel_blocking: (t) => stopMidTool(t, async (fx, pressed) => {
    await pressed;
    blockFor(TOOL_DELAY_MS); // sync work: no signal can be seen meanwhile
    await quietly(fx.refund({ amount: 42 }));
  }),
  cancel_async: (t) => stopMidTool(t, async (fx, pressed) => {
    await pressed;
    await sleep(TOOL_DELAY_MS); // an API call that does not listen to the signal
    await quietly(fx.refund({ amount: 42 }));
  }),
  interrupt_continue: interruptContinue,
};
