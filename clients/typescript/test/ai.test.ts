// The Vercel AI SDK through the adapter, against a real `estop serve`: generateText/streamText
// driven by the SDK's own MockLanguageModelV4, tools gated, estop approvals as the SDK's
// tool-approval flow, the run's stop as the abortSignal.
import assert from "node:assert/strict";
import { once } from "node:events";
import { test } from "node:test";
import { generateText, isStepCount, streamText, tool, type ModelMessage } from "ai";
import { MockLanguageModelV4 } from "ai/test";
import { z } from "zod";
import { RunStopped } from "../src/index.js";
import { approvalResponses, withEstop } from "../src/adapters/ai.js";
import { daemonPerFile, runId } from "./helpers.js";

const daemon = daemonPerFile();

const usage = { inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 1, text: 1, reasoning: 0 } };
const calls = (...c: Array<[string, string, Record<string, unknown>]>) => ({
  content: c.map(([id, name, args]) => ({ type: "tool-call" as const, toolCallId: id, toolName: name, input: JSON.stringify(args) })),
  finishReason: { unified: "tool-calls" as const, raw: undefined },
  usage,
  warnings: [],
});
const text = (t: string) => ({ content: [{ type: "text" as const, text: t }], finishReason: { unified: "stop" as const, raw: undefined }, usage, warnings: [] });

function moneyTools(n: { wire_money: number; send_email: number }) {
  return {
    wire_money: tool({ description: "move money", inputSchema: z.object({ amount: z.number() }), execute: async ({ amount }) => (n.wire_money++, `sent ${amount}`) }),
    send_email: tool({ description: "mail", inputSchema: z.object({ to: z.string() }), execute: async ({ to }) => (n.send_email++, `mailed ${to}`) }),
  };
}

test("an estop hold is the SDK's approval request; the operator approves; it runs once, the sibling with it", async () => {
  const d = daemon.get();
  const run = d.gate().run(runId("ai"));
  const n = { wire_money: 0, send_email: 0 };
  const tools = moneyTools(n);
  const model = new MockLanguageModelV4({ doGenerate: [calls(["c1", "wire_money", { amount: 5 }], ["c2", "send_email", { to: "ops" }]), text("done")] });
  const messages: ModelMessage[] = [{ role: "user", content: "pay and tell ops" }];
  const first = await generateText(withEstop(run, { model, tools, messages, stopWhen: isStepCount(5) }));
  const requests = first.content.filter((p) => p.type === "tool-approval-request");
  assert.deepEqual(requests.map((p) => p.toolCall.toolName).sort(), ["send_email", "wire_money"], "the approval and its sibling both wait");
  assert.deepEqual(n, { wire_money: 0, send_email: 0 });
  messages.push(...first.responseMessages);
  const decided = approvalResponses(run, first.content);
  await d.operator.approve(run.id, "call:wire_money:c1");
  const responses = await decided;
  assert.ok(responses.every((r) => r.approved));
  messages.push({ role: "tool", content: responses });
  const second = await generateText(withEstop(run, { model, tools, messages, stopWhen: isStepCount(5) }));
  assert.equal(second.text, "done");
  assert.deepEqual(n, { wire_money: 1, send_email: 1 });
  // The same continuation again (a retried request): receipts, not a second transfer.
  await generateText(withEstop(run, { model: new MockLanguageModelV4({ doGenerate: [text("done")] }), tools, messages, stopWhen: isStepCount(5) }));
  assert.deepEqual(n, { wire_money: 1, send_email: 1 });
});

test("a rejection is the SDK's denial; an approval the application forges is denied again", async () => {
  const d = daemon.get();
  const run = d.gate().run(runId("ai"));
  const n = { wire_money: 0, send_email: 0 };
  const tools = moneyTools(n);
  const model = new MockLanguageModelV4({ doGenerate: [calls(["r1", "wire_money", { amount: 100 }]), text("ok, not sent")] });
  const messages: ModelMessage[] = [{ role: "user", content: "pay" }];
  const first = await generateText(withEstop(run, { model, tools, messages }));
  const req = first.content.find((p) => p.type === "tool-approval-request");
  assert.ok(req);
  await d.operator.reject(run.id, "call:wire_money:r1");
  assert.deepEqual((await approvalResponses(run, first.content)).map((r) => r.approved), [false]);
  // The application says approved anyway (a bug, or a compromised agent): the gate decides.
  messages.push(...first.responseMessages, { role: "tool", content: [{ type: "tool-approval-response", approvalId: req.approvalId, approved: true }] });
  const second = await generateText(withEstop(run, { model, tools, messages, stopWhen: isStepCount(3) }));
  assert.equal(n.wire_money, 0);
  // The model saw the denial (the SDK's execution-denied output, with estop's reason).
  assert.match(JSON.stringify(model.doGenerateCalls.at(-1)?.prompt), /execution-denied.*estop refused it: rejected/);
});

test("an operator cancel aborts generateText and the tool in flight; the caller's abort leaves the run usable", async () => {
  const d = daemon.get();
  const g = d.gate();
  const run = g.run(runId("ai"));
  let started = 0;
  const slow = tool({
    description: "slow",
    inputSchema: z.object({ q: z.string() }),
    execute: async (_input, { abortSignal }): Promise<string> => {
      started++;
      await once(abortSignal!, "abort");
      if (abortSignal!.aborted) throw abortSignal!.reason;
      return "unreachable";
    },
  });
  const slowTurn = (id: string) => new MockLanguageModelV4({ doGenerate: [calls([id, "slow_search", { q: id }]), text("after")] });
  // The caller aborts first: an interrupt of this generation. The run goes on.
  const ac = new AbortController();
  const p1 = generateText(withEstop(run, { model: slowTurn("s1"), tools: { slow_search: slow }, prompt: "go", abortSignal: ac.signal, stopWhen: isStepCount(3) }));
  p1.catch(() => {}); // it may settle before the operator's reply does; asserted below
  while (started < 1) await new Promise((r) => setImmediate(r));
  ac.abort(new Error("user left"));
  await p1.catch(() => undefined); // the SDK may end the step with a tool error or reject
  assert.equal((await run.status()).state, "active");
  assert.equal(run.signal.aborted, false);
  // Then the operator stops the run: the generation in flight is aborted with its tool.
  const p2 = generateText(withEstop(run, { model: slowTurn("s2"), tools: { slow_search: slow }, prompt: "go", stopWhen: isStepCount(3) }));
  p2.catch(() => {}); // it may settle before the operator's reply does; asserted below
  while (started < 2) await new Promise((r) => setImmediate(r));
  await d.operator.cancel(run.id, "operator stop");
  await assert.rejects(p2); // the next step's model call sees the aborted signal
  assert.ok(run.signal.aborted && run.signal.reason instanceof RunStopped);
  assert.throws(() => withEstop(run, { prompt: "more" }), RunStopped);
  const rep = await d.operator.report(run.id);
  assert.deepEqual((rep.unknown as Array<{ key: string }>).map((e) => e.key).sort(), ["call:slow_search:s1", "call:slow_search:s2"]);
});

test("a stream is cut the moment the run stops", async () => {
  const d = daemon.get();
  const run = d.gate().run(runId("ai"));
  await run.effect({ tool: "lookup_x", args: {} }, () => 1); // the run exists and is watched
  let sent = 0;
  const model = new MockLanguageModelV4({
    doStream: async ({ abortSignal }) => ({
      stream: new ReadableStream({
        async pull(controller) {
          if (sent === 0) controller.enqueue({ type: "text-start", id: "t" });
          if (abortSignal?.aborted) return controller.error(abortSignal.reason);
          controller.enqueue({ type: "text-delta", id: "t", delta: `tok${sent++} ` });
          await new Promise((r) => setImmediate(r));
        },
      }),
    }),
  });
  const result = streamText(withEstop(run, { model, prompt: "talk forever" }));
  let seen = 0;
  for await (const _delta of result.textStream) {
    if (++seen === 5) await d.operator.cancel(run.id, "stop talking");
    if (seen > 100_000) assert.fail("the stream was not cut");
  }
  // The stream ended (it never ends by itself) right after the stop reached this process.
  assert.ok(seen >= 5 && seen < 100_000, `${seen} deltas`);
  assert.ok(run.signal.aborted);
});
