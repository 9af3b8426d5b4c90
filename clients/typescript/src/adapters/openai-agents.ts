// OpenAI Agents JS (`@openai/agents`): gated function tools; an estop hold is the SDK's own pause
// (`result.interruptions` + a `RunState` that survives a restart); the run's stop is the signal.
//
//   import { gateAgentTools, runAgent, applyDecisions } from "estop/openai-agents";
//   const agent = new Agent({ name: "ops", tools: gateAgentTools(gate, [refund, lookup]) });
//   const run = gate.run("ticket-7");
//   let result = await runAgent(run, agent, "refund order 7");
//   while (result.interruptions.length) {
//     const saved = result.state.toString();               // store it: a restart loses nothing
//     const state = await RunState.fromString(agent, saved);
//     await applyDecisions(run, state);                    // waits for the operator, in estop
//     result = await runAgent(run, agent, state);          // runs it once, or the refusal
//   }
//
// * Keys are `call:<tool>:<callId>`: resuming the same saved state twice runs the tool once (the
//   second time the gate answers with the receipt).
// * `needsApproval` is the gate's verdict: each call is admitted (prepared) when the SDK asks, and
//   a call estop holds is an interruption. The tool's own `needsApproval: true` asks estop for an
//   approval (it can strengthen policy, never waive it).
// * `applyDecisions` approves or rejects the interruptions in the RunState from estop's decision
//   (the operator's, on the gate) — an approval written into the state by the application is
//   worth nothing: the tool still goes through the gate (G7).
// * `runAgent` joins the run's signal into the SDK's: an operator cancel aborts the run and a tool
//   in flight; the caller's own signal interrupts this call and the run stays usable.
import { run as sdkRun, type Agent, type FunctionTool, type RunState, type RunToolApprovalItem, type Tool } from "@openai/agents";
import { Aborted, NoRun, Refused, RunStopped } from "../errors.js";
import { toJson } from "../jcs.js";
import { callKey } from "../keys.js";
import type { Estop, Run } from "../run.js";

function currentRun(gate: Estop, tool: string): Run {
  const run = gate.current();
  if (!run) throw new NoRun(`tool ${tool} (run the agent with runAgent(run, ...))`);
  return run;
}

function parseArgs(input: string): unknown {
  try {
    return JSON.parse(input || "null");
  } catch {
    return input; // the SDK reports bad JSON to the model itself; the identity is the text
  }
}

export interface GateToolOptions {
  /** Run the tool's body in a child run (`PARENT.<tool>:<callId>`): for `agent.asTool()` sub-agents. */
  childRun?: boolean;
}

/** A function tool, gated: same name, schema and description; keys from the call id. */
export function gateTool<T extends Tool>(gate: Estop, t: T, opts: GateToolOptions = {}): T {
  if (t.type !== "function") return t; // hosted tools run at the provider: not gateable here
  const f = t as unknown as FunctionTool;
  const gated: FunctionTool = {
    ...f,
    needsApproval: async (ctx, input, callId) => {
      const own = await f.needsApproval(ctx, input, callId);
      if (!callId) return own;
      const run = currentRun(gate, f.name);
      run.check(f.name);
      const v = await gate.client.admit(run.id, callKey(f.name, callId), f.name, {
        args: toJson(input ?? null),
        start: false,
        needsApproval: own,
        parent: run.parent?.id,
        labels: run.labels,
        limits: run.limits,
        signal: run.signal,
      });
      await gate.watch(run.id, {});
      return v.kind === "held";
    },
    invoke: async (ctx, input, details) => {
      const run = currentRun(gate, f.name);
      try {
        return await run.effect(
          { tool: f.name, args: parseArgs(input), callId: details?.toolCall?.callId, signal: details?.signal },
          (signal) => {
            if (!opts.childRun) return f.invoke(ctx, input, { ...details, signal });
            // The sub-agent is a run of its own under this one: its tools find it current, a
            // cancel of the parent reaches it at the gate, and a replay of this call (same call
            // id) finds the same child run and its receipts.
            const child = run.child(`${f.name}:${details?.toolCall?.callId ?? "call"}`);
            return child.enter(() => f.invoke(ctx, input, { ...details, signal: AbortSignal.any([signal, child.signal]) }));
          },
        );
      } catch (e) {
        // A refusal is the tool's output: the model re-plans. A stopped run stops the agent.
        if (e instanceof Refused && !(e instanceof RunStopped)) return `estop refused ${f.name}: ${e.reason}`;
        throw e;
      }
    },
  };
  return gated as unknown as T;
}

export function gateAgentTools<T extends Tool>(gate: Estop, tools: T[]): T[] {
  return tools.map((t) => gateTool(gate, t));
}

/**
 * `agent.asTool(options)`, gated, with the sub-agent in a child run. Gate the sub-agent's own
 * tools with `gateAgentTools` as usual: they find the child run. (Handoffs stay in the same run:
 * they hand over the same conversation; gate each agent's tools.)
 */
export function subAgentTool(gate: Estop, agent: Agent<any, any>, options: { toolName?: string; toolDescription?: string; [k: string]: unknown }): Tool {
  return gateTool(gate, agent.asTool(options as never) as unknown as Tool, { childRun: true });
}

/**
 * `run(agent, input)` inside the estop run: tools find it, and the run's stop aborts the SDK's
 * run (RunStopped); the caller's `signal` aborts this call only (Aborted).
 */
export async function runAgent<A extends Agent<any, any>>(run: Run, agent: A, input: string | RunState<any, A>, options: { signal?: AbortSignal; maxTurns?: number; context?: unknown } = {}) {
  run.check();
  const signal = options.signal ? AbortSignal.any([run.signal, options.signal]) : run.signal;
  try {
    return await run.enter(() => sdkRun(agent, input as string, { ...options, signal } as never));
  } catch (e) {
    if (run.signal.aborted) throw new RunStopped(run.stopped ?? "cancelled", { run: run.id }, true);
    if (options.signal?.aborted) throw new Aborted(options.signal.reason);
    throw e;
  }
}

/**
 * Waits for estop's decision on every interruption of `state` (the gate's `wait`: it answers
 * when the operator decides, no polling) and records it in the state: `approve` where estop
 * approved, `reject` where it rejected or the approval expired. A stopped run throws RunStopped.
 */
export async function applyDecisions(run: Run, state: RunState<any, any>, opts: { signal?: AbortSignal; waitChunkMs?: number } = {}): Promise<Array<{ item: RunToolApprovalItem; approved: boolean }>> {
  const signal = opts.signal ? AbortSignal.any([run.signal, opts.signal]) : run.signal;
  const out: Array<{ item: RunToolApprovalItem; approved: boolean }> = [];
  await Promise.all(
    state.getInterruptions().map(async (item) => {
      const raw = item.rawItem as { callId?: string; name?: string };
      const name = item.name ?? raw.name;
      if (!raw.callId || !name) return;
      const key = callKey(name, raw.callId);
      for (;;) {
        run.check(name, key);
        const v = await run.gate.client.wait(run.id, key, opts.waitChunkMs ?? 30_000, { signal }).catch((e: unknown) => {
          throw run.signal.aborted ? new RunStopped(run.stopped ?? "cancelled", { run: run.id, tool: name, key }, true) : e;
        });
        if (v.kind === "held") continue;
        const approved = v.kind !== "refused";
        if (v.kind === "refused" && (v.reason === "cancelled" || v.reason === "closed" || v.reason === "deadline" || v.reason === "budget")) {
          throw new RunStopped(v.reason, { run: run.id, tool: name, key });
        }
        if (approved) state.approve(item);
        else state.reject(item);
        out.push({ item, approved });
        return;
      }
    }),
  );
  return out;
}
