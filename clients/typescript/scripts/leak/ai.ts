// The Vercel AI SDK: the failure classes without estop (generateText, its own toolApproval flow
// and abortSignal) and through estop/ai (withEstop, approvalResponses, run.cancel), driven by the
// SDK's MockLanguageModelV4.
import { generateText, isStepCount, tool, type ModelMessage } from "ai";
import { MockLanguageModelV4 } from "ai/test";
import { setTimeout as sleep } from "node:timers/promises";
import { z } from "zod";
import { approvalResponses, withEstop } from "../../src/adapters/ai.js";
import { expect, DECIDE_AFTER_MS, SIBLING_WORK_MS, TOOL_DELAY_MS, api, arm, blockFor, quietly, until, type Scenarios, type Trial } from "./common.js";

const usage = { inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 1, text: 1, reasoning: 0 } };
type Turn = Array<[string, string, Record<string, unknown>]> | string | Error;

/** The SDK's mock model answering the n-th scripted turn: tool calls, a text, or a failure. */
function model(script: Turn[]): MockLanguageModelV4 {
  let i = 0;
  return new MockLanguageModelV4({
    doGenerate: async () => {
      const turn = script[Math.min(i++, script.length - 1)] ?? "done";
      if (turn instanceof Error) throw turn;
      if (typeof turn === "string") return { content: [{ type: "text", text: turn }], finishReason: { unified: "stop", raw: undefined }, usage, warnings: [] };
      return {
        content: turn.map(([id, name, args]) => ({ type: "tool-call" as const, toolCallId: id, toolName: name, input: JSON.stringify(args) })),
        finishReason: { unified: "tool-calls", raw: undefined },
        usage,
        warnings: [],
      };
    },
  });
}

const money = z.object({ to: z.string(), amount: z.number() });
const opts = { stopWhen: isStepCount(5), maxRetries: 0 };

/** One conversation turn (plus its approval round trips), decided the SDK's way or estop's. */
async function converse(t: Trial, params: { model: MockLanguageModelV4; tools: Record<string, unknown>; messages: ModelMessage[] }, humanApproves: boolean): Promise<void> {
  const run = t.gate.run(t.runId);
  const gen = () => generateText((t.guarded ? withEstop(run, { ...params, ...opts }) : { ...params, ...opts, toolApproval: { wire_money: "user-approval" } }) as never);
  for (let i = 0; i < 5; i++) {
    const r = (await gen()) as Awaited<ReturnType<typeof generateText>>;
    params.messages.push(...r.responseMessages);
    const requests = r.content.filter((p) => p.type === "tool-approval-request");
    if (!requests.length) return;
    let responses;
    if (t.guarded) responses = await approvalResponses(run, r.content);
    else {
      await sleep(DECIDE_AFTER_MS);
      t.world.mark("decided");
      responses = requests.map((p) => ({ type: "tool-approval-response" as const, approvalId: p.approvalId, approved: humanApproves }));
    }
    params.messages.push({ role: "tool", content: responses });
  }
}

function wire(t: Trial) {
  return tool({ description: "wire money", inputSchema: money, execute: async () => (t.world.do("wire"), "wired") });
}

async function sibling(t: Trial): Promise<number> {
  const fx = api(t);
  const notify = tool({ description: "tell someone", inputSchema: z.object({ to: z.string() }), execute: async ({ to }) => (await sleep(SIBLING_WORK_MS), await quietly(fx.email({ to })), "told") });
  const decided = t.guarded ? await arm(t, "wire_money", "reject") : undefined;
  await converse(t, { model: model([[["c1", "wire_money", { to: "acct-9", amount: 100 }], ["c2", "notify", { to: "ops" }]], "done"]), tools: { wire_money: wire(t), notify }, messages: [{ role: "user", content: "pay and tell ops" }] }, false);
  await decided?.done;
  expect(t.world.count("email", { after: "decided" }) >= 1 || !t.guarded, "the sibling goes on once the decision is made");
  expect(t.world.count("email") >= 1, "the sibling sent its email");
  return t.world.count("email", { before: "decided" });
}

async function reject(t: Trial): Promise<number> {
  const fx = api(t);
  const payInvoice = tool({ description: "pay an invoice", inputSchema: money, execute: async (args) => (await quietly(fx.transfer(args)), "paid") });
  const args = { to: "acct-9", amount: 100 };
  const decided = t.guarded ? await arm(t, "wire_money", "reject") : undefined;
  await converse(t, { model: model([[["c1", "wire_money", args]], [["c2", "pay_invoice", args]], "done"]), tools: { wire_money: wire(t), pay_invoice: payInvoice }, messages: [{ role: "user", content: "pay acct-9" }] }, false);
  await decided?.done;
  expect(t.world.count("wire", { before: "decided" }) === 0, "the flagged transfer waited for the human");
  return t.world.count("wire", { after: "decided" });
}

/** The worker dies after the charge (the next model call fails); the job is redelivered. */
async function replay(t: Trial): Promise<number> {
  const charge = tool({ description: "charge", inputSchema: z.object({ amount: z.number() }), execute: async () => (t.world.do("charge"), "ch_42") });
  for (const script of [[[["c1", "charge", { amount: 42 }]], new Error("worker lost")], [[["c1", "charge", { amount: 42 }]], "done"]] as Turn[][]) {
    await converse(t, { model: model(script), tools: { charge }, messages: [{ role: "user", content: "charge order 42" }] }, true).catch(() => undefined);
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
    description: "refund",
    inputSchema: z.object({ amount: z.number() }),
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
  const run = t.gate.run(t.runId);
  const ac = new AbortController();
  const params = { model: model([[["c1", "refund", { amount: 42 }]], "done"]), tools: { refund }, prompt: "refund", ...opts };
  const p = generateText(t.guarded ? withEstop(run, params) : { ...params, abortSignal: ac.signal });
  p.catch(() => {});
  await until(() => started);
  t.world.mark("stopped");
  // The stop first (a cancel fences this process at once), then the tool goes on: its API
  // call outlasted the user's patience, so its write comes after the stop by construction.
  const stop = t.guarded ? run.cancel("user pressed stop") : ac.abort(new Error("user pressed stop"));
  press();
  await stop;
  await p.catch(() => undefined);
  await until(() => done);
  return t.world.count("refund", { after: "stopped" });
}

async function interruptContinue(t: Trial): Promise<number> {
  const fx = api(t);
  let started = false;
  const slow = tool({ description: "slow", inputSchema: z.object({ q: z.string() }), execute: async (_i, { abortSignal }) => (started = true, await new Promise((r) => abortSignal?.addEventListener("abort", r, { once: true })), "late") });
  const email = tool({ description: "mail", inputSchema: z.object({ to: z.string() }), execute: async ({ to }) => (await quietly(fx.email({ to })), "sent") });
  const run = t.gate.run(t.runId);
  const ac = new AbortController();
  const first = { model: model([[["s1", "slow_search", { q: "x" }]], "done"]), tools: { slow_search: slow }, prompt: "search", abortSignal: ac.signal, ...opts };
  const p = generateText(t.guarded ? withEstop(run, first) : first);
  p.catch(() => {});
  await until(() => started);
  ac.abort(new Error("the user interrupted"));
  await p.catch(() => undefined);
  const next = { model: model([[["e1", "send_email_tool", { to: "ops" }]], "done"]), tools: { send_email_tool: email }, prompt: "then email ops", ...opts };
  await generateText(t.guarded ? withEstop(run, next) : next).catch(() => undefined);
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
