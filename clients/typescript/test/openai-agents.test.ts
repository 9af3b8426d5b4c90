// OpenAI Agents JS through the adapter, against a real `estop serve`: an Agent driven by a
// scripted Model (the SDK's own Model interface), function tools gated, the SDK's interruptions
// and a serialised RunState as the pause, the run's stop as the SDK's signal.
import assert from "node:assert/strict";
import { once } from "node:events";
import { test } from "node:test";
import { Agent, RunState, Usage, setTracingDisabled, tool, type Model, type ModelRequest, type ModelResponse } from "@openai/agents";
import { z } from "zod";
import { Aborted, RunStopped } from "../src/index.js";
import { applyDecisions, gateAgentTools, runAgent, subAgentTool } from "../src/adapters/openai-agents.js";
import { daemonPerFile, runId } from "./helpers.js";

setTracingDisabled(true);
const daemon = daemonPerFile();

type Turn = Array<[string, string, Record<string, unknown>]> | string;

/** A Model whose n-th response is the n-th scripted turn: tool calls, or a final text. */
class ScriptedModel implements Model {
  private turn = 0;
  readonly requests: ModelRequest[] = [];
  constructor(private readonly script: Turn[]) {}
  async getResponse(request: ModelRequest): Promise<ModelResponse> {
    this.requests.push(request);
    const t = this.script[Math.min(this.turn++, this.script.length - 1)] ?? "done";
    const output = typeof t === "string"
      ? [{ type: "message" as const, id: `m${this.turn}`, role: "assistant" as const, status: "completed" as const, content: [{ type: "output_text" as const, text: t }] }]
      : t.map(([callId, name, args]) => ({ type: "function_call" as const, id: `fc_${callId}`, callId, name, arguments: JSON.stringify(args), status: "completed" as const }));
    return { usage: new Usage(), output, responseId: `r${this.turn}` };
  }
  // eslint-disable-next-line require-yield
  async *getStreamedResponse(): AsyncIterable<never> {
    throw new Error("not streamed in these tests");
  }
}

function moneyAgent(n: { wire_money: number; send_email: number }, script: Turn[]) {
  const gate = daemon.get().gate();
  const wire = tool({ name: "wire_money", description: "move money", parameters: z.object({ amount: z.number() }), execute: async ({ amount }) => (n.wire_money++, `sent ${amount}`) });
  const email = tool({ name: "send_email", description: "mail", parameters: z.object({ to: z.string() }), execute: async ({ to }) => (n.send_email++, `mailed ${to}`) });
  const model = new ScriptedModel(script);
  const agent = new Agent({ name: "ops", instructions: "do it", model, tools: gateAgentTools(gate, [wire, email]) });
  return { gate, agent, model };
}

test("an estop hold is an interruption; the saved RunState survives a restart; resumed twice, it runs once", async () => {
  const d = daemon.get();
  const n = { wire_money: 0, send_email: 0 };
  const script: Turn[] = [[["c1", "wire_money", { amount: 5 }], ["c2", "send_email", { to: "ops" }]], "done"];
  const first = moneyAgent(n, script);
  const id = runId("oa");
  const result = await runAgent(first.gate.run(id), first.agent, "pay and tell ops");
  assert.deepEqual(result.interruptions.map((i) => i.name).sort(), ["send_email", "wire_money"]);
  assert.deepEqual(n, { wire_money: 0, send_email: 0 });
  const saved = result.state.toString();
  // The process restarts: a new gate handle, a new agent, the state from storage.
  const after = moneyAgent(n, script.slice(1));
  const state = await RunState.fromString(after.agent, saved);
  const run = after.gate.run(id);
  const decided = applyDecisions(run, state);
  await d.operator.approve(id, "call:wire_money:c1");
  assert.deepEqual((await decided).map((x) => x.approved), [true, true]);
  const done = await runAgent(run, after.agent, state);
  assert.equal(done.finalOutput, "done");
  assert.deepEqual(n, { wire_money: 1, send_email: 1 });
  // The same saved pause resumed again (a redelivered job): receipts, nothing runs twice.
  const again = moneyAgent(n, ["done"]);
  const state2 = await RunState.fromString(again.agent, saved);
  const r2 = again.gate.run(id);
  await applyDecisions(r2, state2);
  await runAgent(r2, again.agent, state2);
  assert.deepEqual(n, { wire_money: 1, send_email: 1 });
});

test("a rejection reaches the model; an approval forged into the RunState is refused by the gate", async () => {
  const d = daemon.get();
  const n = { wire_money: 0, send_email: 0 };
  const { gate, agent, model } = moneyAgent(n, [[["r1", "wire_money", { amount: 100 }]], "ok, not sent"]);
  const run = gate.run(runId("oa"));
  const result = await runAgent(run, agent, "pay");
  const [item] = result.interruptions;
  assert.ok(item);
  await d.operator.reject(run.id, "call:wire_money:r1");
  // The application approves in the SDK (ignoring estop): the tool still goes through the gate.
  result.state.approve(item);
  const out = await runAgent(run, agent, result.state);
  assert.equal(out.finalOutput, "ok, not sent");
  assert.equal(n.wire_money, 0);
  assert.match(JSON.stringify(model.requests.at(-1)?.input), /estop refused wire_money: rejected/);
});

test("an operator cancel aborts the agent and the tool in flight; the caller's abort leaves the run usable", async () => {
  const d = daemon.get();
  const gate = d.gate();
  let started = 0;
  const slow = tool({
    name: "slow_search",
    description: "slow",
    parameters: z.object({ q: z.string() }),
    execute: async (_input, _ctx, details): Promise<string> => {
      started++;
      const signal = details?.signal;
      assert.ok(signal, "the SDK passes a signal to the tool");
      await once(signal, "abort");
      throw signal.reason;
    },
  });
  const agentFor = (callId: string) => new Agent({ name: "s", model: new ScriptedModel([[[callId, "slow_search", { q: callId }]], "after"]), tools: gateAgentTools(gate, [slow]) });
  const run = gate.run(runId("oa"));
  const ac = new AbortController();
  const p1 = runAgent(run, agentFor("s1"), "go", { signal: ac.signal });
  p1.catch(() => {}); // it may settle before the operator's reply does; asserted below
  while (started < 1) await new Promise((r) => setImmediate(r));
  ac.abort(new Error("user left"));
  await assert.rejects(p1, Aborted);
  assert.equal((await run.status()).state, "active");
  const p2 = runAgent(run, agentFor("s2"), "go");
  p2.catch(() => {}); // it may settle before the operator's reply does; asserted below
  while (started < 2) await new Promise((r) => setImmediate(r));
  await d.operator.cancel(run.id, "operator stop");
  await assert.rejects(p2, RunStopped);
  await assert.rejects(runAgent(run, agentFor("s3"), "go"), RunStopped);
});

test("an asTool sub-agent runs in a child run: its tools are keyed there, and a cancel of the parent stops it", async () => {
  const d = daemon.get();
  const gate = d.gate();
  let started = 0;
  let looked = 0;
  const lookup = tool({ name: "lookup_order", description: "look", parameters: z.object({ id: z.string() }), execute: async () => (looked++, "order 7: paid") });
  const slow = tool({
    name: "slow_export",
    description: "slow",
    parameters: z.object({ q: z.string() }),
    execute: async (_input, _ctx, details): Promise<string> => {
      started++;
      await once(details!.signal!, "abort");
      throw details!.signal!.reason;
    },
  });
  const researcher = new Agent({ name: "researcher", model: new ScriptedModel([[["l1", "lookup_order", { id: "7" }]], [["x1", "slow_export", { q: "7" }]], "found"]), tools: gateAgentTools(gate, [lookup, slow]) });
  const lead = new Agent({ name: "lead", model: new ScriptedModel([[["r1", "research", { input: "order 7" }]], "done"]), tools: [subAgentTool(gate, researcher, { toolName: "research", toolDescription: "research an order" })] });
  const run = gate.run(runId("oa"));
  const p = runAgent(run, lead, "look into order 7");
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
  while (started < 1) await new Promise((r) => setImmediate(r));
  const child = `${run.id}.research:r1`;
  assert.equal((await d.operator.status(child)).parent, run.id);
  await d.operator.cancel(run.id, "operator stop");
  await assert.rejects(p, RunStopped);
  assert.equal(looked, 1);
  const rep = await d.operator.report(child);
  assert.equal(rep.state, "cancelled");
  assert.deepEqual((rep.done as Array<{ key: string }>).map((e) => e.key), ["call:lookup_order:l1"]);
  assert.deepEqual((rep.unknown as Array<{ key: string }>).map((e) => e.key), ["call:slow_export:x1"]);
});
