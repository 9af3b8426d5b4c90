// The Vercel AI SDK with estop in a minute: the refund tool's call becomes the SDK's own
// tool-approval request; the decision is the operator's in estop (here this script plays the
// operator; a person would run `estop approve RUN KEY`).
// Run: npm run build && node dist/examples/ai-sdk.js
import { generateText, isStepCount, tool, type ModelMessage } from "ai";
import { MockLanguageModelV4 } from "ai/test";
import { z } from "zod";
import { approvalResponses, withEstop } from "../src/adapters/ai.js";
import { Daemon } from "../src/testing.js";

const usage = { inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 1, text: 1, reasoning: 0 } };
// Stands in for your model: asks for the refund, then answers.
const model = new MockLanguageModelV4({
  doGenerate: [
    { content: [{ type: "tool-call", toolCallId: "call_1", toolName: "wire_money", input: JSON.stringify({ to: "acct-9", amount: 1999 }) }], finishReason: { unified: "tool-calls", raw: undefined }, usage, warnings: [] },
    { content: [{ type: "text", text: "Refund sent." }], finishReason: { unified: "stop", raw: undefined }, usage, warnings: [] },
  ],
});

const daemon = await Daemon.start(); // `estop serve` on a temp dir; wire_money needs approval
const run = daemon.gate().run(`chat-${Date.now()}`);
const tools = { wire_money: tool({ description: "wire money", inputSchema: z.object({ to: z.string(), amount: z.number() }), execute: async ({ to, amount }) => `sent ${amount} to ${to}` }) };
const messages: ModelMessage[] = [{ role: "user", content: "refund order 42" }];

const first = await generateText(withEstop(run, { model, tools, messages, stopWhen: isStepCount(5) }));
messages.push(...first.responseMessages);
for (const p of first.content) if (p.type === "tool-approval-request") console.log("approval requested:", p.toolCall.toolName, p.reason);
const decided = approvalResponses(run, first.content); // waits for estop's decision
await daemon.operator.approve(run.id, "call:wire_money:call_1"); // the operator, in estop
messages.push({ role: "tool", content: await decided });
const second = await generateText(withEstop(run, { model, tools, messages, stopWhen: isStepCount(5) }));
console.log("answer:", second.text);
await daemon.stop();
