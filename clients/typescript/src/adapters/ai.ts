// The Vercel AI SDK (`ai`): gated tools, estop approvals as the SDK's own tool-approval flow, and
// the run's stop wired into `abortSignal` (a stream is cut the moment the run stops).
//
//   import { withEstop, approvalResponses } from "estop/ai";
//   const run = gate.run("chat-42");
//   const result = await generateText(withEstop(run, { model, tools, messages }));
//   messages.push(...result.responseMessages);
//   const decided = await approvalResponses(run, result.content);  // the operator decides in estop
//   if (decided.length) messages.push({ role: "tool", content: decided });  // then call again
//
// * Every tool call is admitted by the gate with the key `call:<tool>:<toolCallId>` (stable across
//   the approval round trip and any retry of that call), and `execute` runs only on `go`.
// * `toolApproval` becomes the gate's verdict: a call estop holds is a `tool-approval-request`
//   (whatever your own `toolApproval` says — it can ask for approval, or deny, never waive one),
//   a refusal is an automatic denial the model sees. `approvalResponses` waits (on the gate, no
//   polling) for the operator's decision and writes the SDK's `tool-approval-response`s from it.
//   An approval your application forges is re-checked on the next call and denied if estop did
//   not approve: an agent never approves (G7).
// * `abortSignal` is the run's signal joined with yours: an operator cancel, a deadline or
//   `run.cancel()` aborts the generation and any stream; your own abort interrupts this call and
//   the run stays usable.
import type { ToolApprovalResponse } from "ai";
import { RunStopped, refusal } from "../errors.js";
import { toJson } from "../jcs.js";
import { callKey } from "../keys.js";
import type { Run } from "../run.js";
import type { Verdict } from "../verdicts.js";

/** What gating reads of an AI SDK tool (a `tool({...})` object). */
interface AiTool {
  execute?: (input: unknown, options: { toolCallId: string; abortSignal?: AbortSignal } & Record<string, unknown>) => unknown;
  [k: string]: unknown;
}

type Status = undefined | "not-applicable" | "approved" | "denied" | "user-approval" | { type: string; reason?: string };
type ApprovalFn = (options: { toolCall: { toolName: string; toolCallId: string; input: unknown }; [k: string]: unknown }) => Status | PromiseLike<Status>;

export interface WithEstopOptions {
  /** Tools that ask estop for approval even where policy allows. */
  needsApproval?: string[];
}

/** The tools, each `execute` admitted by the gate first (keys from the toolCallId). */
export function gateTools<T extends object>(run: Run, tools: T): T {
  const out: Record<string, AiTool> = {};
  for (const [name, t] of Object.entries(tools as Record<string, AiTool>)) {
    const execute = t.execute;
    if (!execute) {
      out[name] = t;
      continue;
    }
    out[name] = {
      ...t,
      execute: (input: unknown, options: { toolCallId: string; abortSignal?: AbortSignal } & Record<string, unknown>) =>
        run.effect({ tool: name, args: input, callId: options.toolCallId, signal: options.abortSignal }, (signal) => execute(input, { ...options, abortSignal: signal })),
    };
  }
  return out as T;
}

function statusType(s: Status): string {
  return s === undefined ? "not-applicable" : typeof s === "string" ? s : s.type;
}

/** The gate's verdict as the SDK's approval status. */
function asStatus(v: Verdict, run: Run, key: string): Status {
  switch (v.kind) {
    case "held":
      return {
        type: "user-approval",
        reason: v.reason === "approval" ? `estop: an operator decides (\`estop approve ${run.id} ${key}\` or \`estop reject ...\`)` : v.reason === "sibling" ? "estop: waits for another action of this run to be approved" : "estop: the run is paused",
      };
    case "refused":
      return { type: "denied", reason: `estop refused it: ${v.reason}${v.message ? ` (${v.message})` : ""}` };
    default:
      return "not-applicable"; // admitted (prepared) or a receipt: execute goes through the gate
  }
}

/**
 * A `toolApproval` function whose answer is the gate's: each call is admitted (prepared) here,
 * so a held call surfaces as the SDK's approval request before anything of the step runs. Your
 * own `toolApproval` may strengthen (`user-approval` → estop approval; `denied`), never weaken.
 */
export function toolApproval(run: Run, own?: ApprovalFn | Record<string, Status>, opts: WithEstopOptions = {}): ApprovalFn {
  return async (options) => {
    const { toolName, toolCallId, input } = options.toolCall;
    const mine = typeof own === "function" ? await own(options) : own?.[toolName];
    if (statusType(mine) === "denied") return mine;
    const key = callKey(toolName, toolCallId);
    run.check(toolName, key);
    const v = await run.gate.client.admit(run.id, key, toolName, {
      args: toJson(input ?? null),
      start: false,
      needsApproval: statusType(mine) === "user-approval" || opts.needsApproval?.includes(toolName),
      parent: run.parent?.id,
      labels: run.labels,
      limits: run.limits,
      signal: run.signal,
    });
    await run.gate.watch(run.id, {});
    return asStatus(v, run, key);
  };
}

/** The run's signal joined with the caller's: the run's stop aborts, the caller's interrupts. */
export function abortSignal(run: Run, signal?: AbortSignal): AbortSignal {
  return signal ? AbortSignal.any([run.signal, signal]) : run.signal;
}

/** `generateText`/`streamText`/`ToolLoopAgent` options with the run wired in (see the module doc). */
export function withEstop<P extends object>(run: Run, params: P, opts: WithEstopOptions = {}): P {
  run.check();
  const p = params as { tools?: object; toolApproval?: ApprovalFn | Record<string, Status>; abortSignal?: AbortSignal };
  return {
    ...params,
    ...(p.tools ? { tools: gateTools(run, p.tools) } : {}),
    toolApproval: toolApproval(run, p.toolApproval, opts),
    abortSignal: abortSignal(run, p.abortSignal),
  };
}

interface ApprovalRequest { type: string; approvalId?: string; isAutomatic?: boolean; toolCall?: { toolName: string; toolCallId: string } }

/**
 * Waits for estop's decision on each approval request in `content` (the gate's `wait`: an event,
 * not polling) and returns the SDK's `tool-approval-response`s carrying that decision. The
 * caller's `signal` interrupts the waiting only. A stopped run throws `RunStopped`.
 */
export async function approvalResponses(run: Run, content: readonly unknown[], opts: { signal?: AbortSignal; waitChunkMs?: number } = {}): Promise<ToolApprovalResponse[]> {
  const requests = (content as ApprovalRequest[]).filter((p) => p.type === "tool-approval-request" && !p.isAutomatic && p.toolCall && p.approvalId);
  const signal = abortSignal(run, opts.signal);
  return Promise.all(
    requests.map(async (p): Promise<ToolApprovalResponse> => {
      const { toolName, toolCallId } = p.toolCall!;
      const key = callKey(toolName, toolCallId);
      for (;;) {
        run.check(toolName, key);
        const v = await run.gate.client.wait(run.id, key, opts.waitChunkMs ?? 30_000, { signal }).catch((e: unknown) => {
          throw run.signal.aborted ? new RunStopped(run.stopped ?? "cancelled", { run: run.id, tool: toolName, key }, true) : e;
        });
        if (v.kind === "held") continue;
        if (v.kind === "refused") {
          if (v.reason !== "rejected" && v.reason !== "expired" && v.reason !== "denied") throw refusal(v.reason, { run: run.id, key, tool: toolName }, v.message);
          return { type: "tool-approval-response", approvalId: p.approvalId!, approved: false, reason: `estop: ${v.reason}` };
        }
        return { type: "tool-approval-response", approvalId: p.approvalId!, approved: true, reason: "estop: approved by an operator" };
      }
    }),
  );
}
