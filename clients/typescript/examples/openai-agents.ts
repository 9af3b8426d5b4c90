// OpenAI Agents JS with estop in a minute: the refund is an interruption of the SDK's own run,
// its RunState saved as a string (a restart loses nothing); the operator decides in estop (here
// this script plays the operator; a person would run `estop approve RUN KEY`).
// Run: npm run build && node dist/examples/openai-agents.js
import { Agent, RunState, Usage, setTracingDisabled, tool, type Model, type ModelResponse } from "@openai/agents";
import { z } from "zod";
import { applyDecisions, gateAgentTools, runAgent } from "../src/adapters/openai-agents.js";
import { Daemon } from "../src/testing.js";

setTracingDisabled(true);
/** Stands in for your model: asks for the refund, then answers. */
class Scripted implements Model {
  private n = 0;
  async getResponse(): Promise<ModelResponse> {
    const output = this.n++ === 0
      ? [{ type: "function_call" as const, callId: "call_1", name: "wire_money", arguments: JSON.stringify({ to: "acct-9", amount: 1999 }), status: "completed" as const }]
      : [{ type: "message" as const, role: "assistant" as const, status: "completed" as const, content: [{ type: "output_text" as const, text: "Refund sent." }] }];
    return { usage: new Usage(), output };
  }
  // eslint-disable-next-line require-yield
  async *getStreamedResponse(): AsyncIterable<never> {
    throw new Error("not used");
  }
}

const daemon = await Daemon.start(); // `estop serve` on a temp dir; wire_money needs approval
const gate = daemon.gate();
const wire = tool({ name: "wire_money", description: "wire money", parameters: z.object({ to: z.string(), amount: z.number() }), execute: async ({ to, amount }) => `sent ${amount} to ${to}` });
const agent = new Agent({ name: "ops", model: new Scripted(), tools: gateAgentTools(gate, [wire]) });
const run = gate.run(`ticket-${Date.now()}`);

let result = await runAgent(run, agent, "refund order 42");
while (result.interruptions.length) {
  const saved = result.state.toString(); // store it anywhere
  console.log("paused on:", result.interruptions.map((i) => i.name).join(", "));
  const state = await RunState.fromString(agent, saved);
  await daemon.operator.approve(run.id, "call:wire_money:call_1"); // the operator, in estop
  await applyDecisions(run, state);
  result = await runAgent(run, agent, state);
}
console.log("answer:", result.finalOutput);
await daemon.stop();
