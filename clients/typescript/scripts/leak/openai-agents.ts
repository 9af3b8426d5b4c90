// OpenAI Agents JS: the failure classes without estop (run(), needsApproval, interruptions and
// RunState, the SDK's signal) and through estop/openai-agents (gateAgentTools, runAgent,
// applyDecisions, run.cancel), driven by a scripted Model.
import { Agent, Usage, run as sdkRun, tool, type Model, type ModelResponse, type RunState, type Tool } from "@openai/agents";
import { setTimeout as sleep } from "node:timers/promises";
import { z } from "zod";
import { applyDecisions, gateAgentTools, runAgent } from "../../src/adapters/openai-agents.js";
import { expect, DECIDE_AFTER_MS, SIBLING_WORK_MS, TOOL_DELAY_MS, api, arm, blockFor, quietly, until, type Scenarios, type Trial } from "./common.js";

type Turn = Array<[string, string, Record<string, unknown>]> | string | Error;

class ScriptedModel implements Model {
  private turn = 0;
  constructor(private readonly script: Turn[]) {}
  async getResponse(): Promise<ModelResponse> {
    const t = this.script[Math.min(this.turn++, this.script.length - 1)] ?? "done";
    if (t instanceof Error) throw t;
    const output = typeof t === "string"
      ? [{ type: "message" as const, id: `m${this.turn}`, role: "assistant" as const, status: "completed" as const, content: [{ type: "output_text" as const, text: t }] }]
      : t.map(([callId, name, args]) => ({ type: "function_call" as const, id: `fc_${callId}`, callId, name, arguments: JSON.stringify(args), status: "completed" as const }));
    return { usage: new Usage(), output, responseId: `r${this.turn}` };
  }
  // eslint-disable-next-line require-yield
  async *getStreamedResponse(): AsyncIterable<never> {
    throw new Error("not streamed");
  }
}

const money = z.object({ to: z.string(), amount: z.number() });

function agent(t: Trial, tools: Tool[], script: Turn[]) {
  return new Agent({ name: "ops", instructions: "do it", model: new ScriptedModel(script), tools: t.guarded ? gateAgentTools(t.gate, tools) : tools });
}

function start(t: Trial, a: Agent, input: string | RunState<any, any>, signal?: AbortSignal) {
  return t.guarded ? runAgent(t.gate.run(t.runId), a, input, signal ? { signal } : {}) : sdkRun(a, input as string, signal ? { signal } : {});
}

/** Runs to the end, deciding each interruption the SDK's way (the human) or estop's (the operator). */
async function drive(t: Trial, a: Agent, input: string, approve: boolean): Promise<void> {
  let r = await start(t, a, input);
  while (r.interruptions.length) {
    const state = r.state;
    if (t.guarded) await applyDecisions(t.gate.run(t.runId), state);
    else {
      await sleep(DECIDE_AFTER_MS);
      t.world.mark("decided");
      for (const it of r.interruptions) (approve ? state.approve(it) : state.reject(it));
    }
    r = await start(t, a, state);
  }
}

const wire = (t: Trial) => tool({ name: "wire_money", description: "wire money", parameters: money, needsApproval: true, execute: async () => (t.world.do("wire"), "wired") });

async function sibling(t: Trial): Promise<number> {
  const fx = api(t);
  const notify = tool({ name: "notify", description: "tell someone", parameters: z.object({ to: z.string() }), execute: async ({ to }) => (await sleep(SIBLING_WORK_MS), await quietly(fx.email({ to })), "told") });
  const decided = t.guarded ? await arm(t, "wire_money", "reject") : undefined;
  await drive(t, agent(t, [wire(t), notify], [[["c1", "wire_money", { to: "acct-9", amount: 100 }], ["c2", "notify", { to: "ops" }]], "done"]), "pay and tell ops", false);
  await decided?.done;
  expect(t.world.count("email", { after: "decided" }) >= 1 || !t.guarded, "the sibling goes on once the decision is made");
  expect(t.world.count("email") >= 1, "the sibling sent its email");
  return t.world.count("email", { before: "decided" });
}

async function reject(t: Trial): Promise<number> {
  const fx = api(t);
  const payInvoice = tool({ name: "pay_invoice", description: "pay an invoice", parameters: money, execute: async (args) => (await quietly(fx.transfer(args)), "paid") });
  const args = { to: "acct-9", amount: 100 };
  const decided = t.guarded ? await arm(t, "wire_money", "reject") : undefined;
  await drive(t, agent(t, [wire(t), payInvoice], [[["c1", "wire_money", args]], [["c2", "pay_invoice", args]], "done"]), "pay acct-9", false);
  await decided?.done;
  expect(t.world.count("wire", { before: "decided" }) === 0, "the flagged transfer waited for the human");
  return t.world.count("wire", { after: "decided" });
}

async function replay(t: Trial): Promise<number> {
  const charge = tool({ name: "charge", description: "charge", parameters: z.object({ amount: z.number() }), execute: async () => (t.world.do("charge"), "ch_42") });
  for (const script of [[[["c1", "charge", { amount: 42 }]], new Error("worker lost")], [[["c1", "charge", { amount: 42 }]], "done"]] as Turn[][]) {
    await drive(t, agent(t, [charge], script), "charge order 42", true).catch(() => undefined);
  }
  expect(t.world.count("charge") >= 1, "the charge happened");
  return t.world.count("charge") - 1;
}

async function stopMidTool(t: Trial, body: (fx: ReturnType<typeof api>, pressed: Promise<void>) => Promise<void>): Promise<number> {
  const fx = api(t);
  let started = false;
  let done = false;
  let press = () => {};
  const pressed = new Promise<void>((r) => (press = r));
  const refund = tool({
    name: "refund",
    description: "refund",
    parameters: z.object({ amount: z.number() }),
    execute: async () => {
      started = true;
      try {
        await body(fx, pressed);
      } finally {
        done = true;
      }
      return "refunded";
    },
  });
  const ac = new AbortController();
  const p = start(t, agent(t, [refund], [[["c1", "refund", { amount: 42 }]], "done"]), "refund", t.guarded ? undefined : ac.signal);
  p.catch(() => {});
  await until(() => started);
  t.world.mark("stopped");
  // The stop first (a cancel fences this process at once), then the tool goes on: its API
  // call outlasted the user's patience, so its write comes after the stop by construction.
  const stop = t.guarded ? t.gate.run(t.runId).cancel("user pressed stop") : ac.abort(new Error("user pressed stop"));
  press();
  await stop;
  await p.catch(() => undefined);
  await until(() => done);
  return t.world.count("refund", { after: "stopped" });
}

async function interruptContinue(t: Trial): Promise<number> {
  const fx = api(t);
  let started = false;
  const slow = tool({ name: "slow_search", description: "slow", parameters: z.object({ q: z.string() }), execute: async (_i, _c, d) => (started = true, await new Promise((r) => d?.signal?.addEventListener("abort", r, { once: true })), "late") });
  const email = tool({ name: "send_email_tool", description: "mail", parameters: z.object({ to: z.string() }), execute: async ({ to }) => (await quietly(fx.email({ to })), "sent") });
  const ac = new AbortController();
  const p = start(t, agent(t, [slow], [[["s1", "slow_search", { q: "x" }]], "done"]), "search", ac.signal);
  p.catch(() => {});
  await until(() => started);
  ac.abort(new Error("the user interrupted"));
  await p.catch(() => undefined);
  await drive(t, agent(t, [email], [[["e1", "send_email_tool", { to: "ops" }]], "done"]), "then email ops", true).catch(() => undefined);
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
