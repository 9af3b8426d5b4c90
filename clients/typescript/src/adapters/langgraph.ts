// LangGraph.js: gated tools and nodes; a hold is LangGraph's own `interrupt()`; thread = run.
//
//   import { toolNode, gateNode, invoke, resume } from "estop/langgraph";
//   graph.addNode("tools", toolNode(gate, [refund, lookup]))      // tools gated, keys = tool_call_id
//   graph.addNode("charge", gateNode(gate, "charge", chargeNode), { retryPolicy })  // effects inside gated
//   await invoke(gate, app, input, { configurable: { thread_id: "order-42" } })   // run = thread id
//   for await (const chunk of stream(gate, app, input, config)) ...               // the same, streamed
//
// * A tool call's key is `call:<tool>:<tool_call_id>`, so a resume, a retry and a replay of the
//   same call present the same key and the gate answers with the receipt: exactly once.
// * `toolNode` admits every tool call of the turn (prepared, not started) before starting any,
//   so a sibling cannot slip through in the instant before another call's approval is recorded.
// * A held effect raises `interrupt()` with a HumanInterrupt-shaped payload (plus `estop`: run,
//   key, reason). The decision is made on estop's operator side (`estop approve`, the console);
//   `awaitDecision` waits for it (an event, not polling) and `resume` continues the thread.
//   Whatever value the application resumes with is ignored: an agent never approves (G7).
// * Interrupt is not cancel: the caller's `signal`, a timeout, or breaking out of a stream stops
//   this invocation; the thread's run stays usable. `cancel(gate, config)` is the explicit stop.
import { tool as lcTool, type StructuredToolInterface } from "@langchain/core/tools";
import type { RunnableConfig } from "@langchain/core/runnables";
import { Command, interrupt, isGraphInterrupt } from "@langchain/langgraph";
import { ToolNode } from "@langchain/langgraph/prebuilt";
import { Aborted, HeldForApproval, NoRun, Refused, RunStopped } from "../errors.js";
import { callKey } from "../keys.js";
import type { Estop, Run } from "../run.js";
import { toJson, type Json } from "../jcs.js";
import type { Held } from "../verdicts.js";

export interface GateToolsOptions {
  /** Tools that ask for approval even where policy allows (policy can always require it too). */
  needsApproval?: string[] | ((name: string, args: unknown) => boolean);
}

/** The interrupt value of a hold: HumanInterrupt-shaped, so agent inbox UIs render it. */
export interface EstopInterrupt {
  action_request: { action: string; args: unknown };
  config: { allow_ignore: false; allow_respond: false; allow_edit: false; allow_accept: false };
  description: string;
  estop: {
    run: string; key: string; tool: string; reason: string; approval: string | null; expires_at: number | null;
    /** Other calls of the same turn held with it (their approvals, or behind it). */
    others?: Array<{ key: string; tool: string; reason: string }>;
  };
}

/** A LangChain tool (StructuredTool, DynamicStructuredTool, `tool(...)`), as far as gating needs. */
export type LcTool = Pick<StructuredToolInterface, "name" | "description"> & { schema: unknown; invoke: (input: never, config?: RunnableConfig) => Promise<unknown> };

type Config = RunnableConfig & { toolCall?: { id?: string }; configurable?: Record<string, unknown> };

/** The thread's run: `configurable.thread_id` (thread = run). */
export function threadRun(gate: Estop, config: Config | undefined): Run {
  const id = config?.configurable?.thread_id;
  if (typeof id !== "string" || !id) throw new NoRun("a LangGraph node without configurable.thread_id");
  return gate.run(id, { parent: undefined });
}

export function holdPayload(e: HeldForApproval, args: unknown): EstopInterrupt {
  const r = e.held.reason;
  const description =
    r === "approval"
      ? `${e.tool} awaits an operator's approval. Decide in estop: \`estop approve ${e.run} ${e.key}\` or \`estop reject ${e.run} ${e.key}\` (or the console).`
      : r === "sibling"
        ? `${e.tool} waits: another effect of run ${e.run} awaits an operator's approval (\`estop pending --run ${e.run}\`).`
        : `${e.tool} waits: run ${e.run} is paused (\`estop resume ${e.run}\`).`;
  return {
    action_request: { action: e.tool, args },
    config: { allow_ignore: false, allow_respond: false, allow_edit: false, allow_accept: false },
    description,
    estop: { run: e.run, key: e.key, tool: e.tool, reason: e.held.reason, approval: e.held.approval, expires_at: e.held.expiresAt },
  };
}

/** Runs `attempt` (an effect with onHold "raise"); each hold becomes one `interrupt()`. */
async function heldAsInterrupt<T>(attempt: () => Promise<T>, args: unknown): Promise<T> {
  for (;;) {
    try {
      return await attempt();
    } catch (e) {
      if (!(e instanceof HeldForApproval)) throw e;
      // First execution: throws GraphInterrupt (the thread pauses). On resume it returns the
      // application's value, which is ignored: the gate's verdict on the next attempt decides.
      interrupt(holdPayload(e, args));
    }
  }
}

function needs(opts: GateToolsOptions, name: string, args: unknown): boolean {
  const n = opts.needsApproval;
  return Array.isArray(n) ? n.includes(name) : typeof n === "function" ? n(name, args) : false;
}

/** Refusals go back to the model as the tool's output (it re-plans); a stopped run throws. */
function refusalText(e: Refused): string {
  return `estop refused ${e.tool ?? "this call"}: ${e.reason}${e.reason === "rejected" ? " (an operator rejected it; do not retry it by another route)" : ""}`;
}

/** The tool, gated: same name, description and schema; keys from the tool_call_id. */
export function gateTool(gate: Estop, t: LcTool, opts: GateToolsOptions = {}): StructuredToolInterface {
  const name = t.name;
  const gated = lcTool(
    async (input: unknown, config: Config) => {
      const run = threadRun(gate, config);
      const callId = config.toolCall?.id;
      const { toolCall: _tc, ...inner } = config;
      try {
        return await heldAsInterrupt(
          () =>
            run.effect(
              { tool: name, args: input, callId, needsApproval: needs(opts, name, input), onHold: "raise", signal: config.signal },
              (signal) => t.invoke(input as never, { ...inner, signal }),
            ),
          input,
        );
      } catch (e) {
        if (e instanceof Refused && !(e instanceof RunStopped)) return refusalText(e);
        throw e;
      }
    },
    { name, description: t.description, schema: t.schema as never },
  );
  return gated as unknown as StructuredToolInterface;
}

export function gateTools(gate: Estop, tools: readonly LcTool[], opts: GateToolsOptions = {}): StructuredToolInterface[] {
  return tools.map((t) => gateTool(gate, t, opts));
}

interface ToolCallLike { id?: string; name: string; args: unknown }

/** The interrupt of a turn whose calls are held: the first approval (else the first hold) leads. */
function turnPayload(held: Array<{ call: ToolCallLike & { id: string }; v: Held; key: string }>, run: Run): EstopInterrupt {
  const lead = held.find((h) => h.v.reason === "approval") ?? held[0]!;
  const p = holdPayload(new HeldForApproval(run.id, lead.key, lead.call.name, lead.v), lead.call.args);
  p.estop.others = held.filter((h) => h !== lead).map((h) => ({ key: h.key, tool: h.call.name, reason: h.v.reason }));
  return p;
}

/**
 * A ToolNode whose tools are gated, admitting the whole turn first: every tool call of the last
 * AI message is admitted prepared (`start: false`) before any starts. If any is held, the node
 * raises one `interrupt()` for the turn (nothing of it has started: once one call awaits approval
 * the others are held too, `sibling`, with no window between); on resume it admits again and,
 * when nothing is held, runs the ToolNode, whose gated tools start their prepared admissions.
 */
export function toolNode(gate: Estop, tools: readonly LcTool[], opts: GateToolsOptions = {}): (state: { messages: unknown[] }, config: RunnableConfig) => Promise<unknown> {
  const node = new ToolNode(gateTools(gate, tools, opts));
  return async (state, config) => {
    const run = threadRun(gate, config as Config);
    const last = state.messages[state.messages.length - 1] as { tool_calls?: ToolCallLike[] } | undefined;
    const calls = (last?.tool_calls ?? []).filter((c): c is ToolCallLike & { id: string } => typeof c.id === "string");
    for (;;) {
      run.check();
      const verdicts = await Promise.all(
        calls.map((c) =>
          gate.client.admit(run.id, callKey(c.name, c.id), c.name, {
            args: toJson(c.args ?? null),
            start: false,
            needsApproval: needs(opts, c.name, c.args),
            parent: run.parent?.id,
            labels: run.labels,
            limits: run.limits,
            signal: config.signal,
          }),
        ),
      );
      const held = calls.flatMap((call, i) => {
        const v = verdicts[i];
        return v?.kind === "held" ? [{ call, v, key: callKey(call.name, call.id) }] : [];
      });
      if (!held.length) break;
      await gate.watch(run.id, {});
      interrupt(turnPayload(held, run)); // returns on resume: admit again, the gate decides
    }
    const out = node.invoke(state, config);
    // LangGraph stops awaiting a node when its signal aborts; the rejection is still ours.
    out.catch(() => {});
    return out;
  };
}

/**
 * A node whose effects (functions made with `gate.effect`, or `run.effect` calls) are gated with
 * keys from the node and superstep, counted from 1 in each execution: a RetryPolicy's retry or a
 * resume of the node presents the same keys (receipts, not second charges). A hold inside is an
 * `interrupt()`; the node re-executes on resume and what already happened returns its receipt.
 */
export function gateNode<S, U>(gate: Estop, name: string, fn: (state: S, config: RunnableConfig) => Promise<U> | U): (state: S, config: RunnableConfig) => Promise<U> {
  return async (state, config) => {
    const run = threadRun(gate, config as Config);
    const meta = (config.metadata ?? {}) as Record<string, unknown>;
    const step = `${name}@${String(meta.langgraph_step ?? "?")}${meta.langgraph_checkpoint_ns ? `/${String(meta.langgraph_checkpoint_ns).split(":")[0]}` : ""}`;
    return heldAsInterrupt(() => run.enter(() => gate.step(step, async () => fn(state, config), "raise")), { node: name });
  };
}

function withRunSignal(run: Run, config: RunnableConfig): RunnableConfig {
  return { ...config, signal: config.signal ? AbortSignal.any([config.signal, run.signal]) : run.signal };
}

/** Why an invocation ended early: the run's stop (RunStopped) or the caller's (Aborted). */
function stopped(run: Run, config: RunnableConfig, e: unknown): unknown {
  if (isGraphInterrupt(e as Error)) return e;
  if (run.signal.aborted) return run.signal.reason instanceof RunStopped ? run.signal.reason : new RunStopped(run.stopped ?? "cancelled", { run: run.id }, true);
  if (config.signal?.aborted) return new Aborted(config.signal.reason);
  return e;
}

interface Invokable {
  invoke(input: unknown, config?: RunnableConfig): Promise<unknown>;
  getState(config: RunnableConfig): Promise<{ tasks: Array<{ interrupts?: Array<{ value?: unknown }> }> }>;
}

/**
 * `graph.invoke` in the thread's run: the run's stop aborts the graph (RunStopped); the caller's
 * signal aborts this invocation only (Aborted) and the run goes on.
 */
export async function invoke(gate: Estop, graph: Invokable, input: unknown, config: RunnableConfig): Promise<unknown> {
  const run = threadRun(gate, config as Config);
  run.check();
  try {
    return await run.enter(() => graph.invoke(input, withRunSignal(run, config)));
  } catch (e) {
    throw stopped(run, config, e);
  }
}

/**
 * `graph.stream` in the thread's run, wired like `invoke`. Breaking out of the loop early is an
 * interrupt of this invocation: the thread's run goes on (nothing here cancels it).
 */
export async function* stream(gate: Estop, graph: Invokable & { stream(input: unknown, config?: RunnableConfig): Promise<AsyncIterable<unknown>> }, input: unknown, config: RunnableConfig): AsyncGenerator<unknown> {
  const run = threadRun(gate, config as Config);
  run.check();
  try {
    const chunks = await run.enter(() => graph.stream(input, withRunSignal(run, config)));
    for await (const chunk of chunks) yield chunk;
  } catch (e) {
    throw stopped(run, config, e);
  }
}

/** The estop holds the thread is paused on (empty when it is not). */
export async function pendingHolds(graph: Invokable, config: RunnableConfig): Promise<EstopInterrupt[]> {
  const st = await graph.getState(config);
  return st.tasks.flatMap((t) => (t.interrupts ?? []).map((i) => i.value)).filter((v): v is EstopInterrupt => typeof v === "object" && v !== null && "estop" in v);
}

/**
 * Waits until what holds the effect is over — the operator decided it (approval), decided the
 * approval it waits behind (sibling), resumed the run (paused) — or the run stopped. Event
 * driven (the run's `decided`/`resumed`/stop events), and it consumes nothing: `resume` then
 * continues the thread and the gate's verdict decides whether the effect runs (once).
 */
export async function awaitDecision(gate: Estop, hold: EstopInterrupt, opts: { signal?: AbortSignal } = {}): Promise<"decided" | "stopped"> {
  const { run, key, reason } = hold.estop;
  const r = gate.run(run, { parent: undefined });
  const over = async (): Promise<boolean> => {
    if (reason === "paused") return (await gate.client.status(run)).state !== "paused";
    const pend = await gate.client.pending(run);
    const keys = new Set([key, ...(hold.estop.others ?? []).filter((o) => o.reason === "approval").map((o) => o.key)]);
    return reason === "approval" ? !pend.some((x) => keys.has(String(x.key))) : pend.length === 0;
  };
  return new Promise((resolve, reject) => {
    let off = () => {};
    const finish = (v: "decided" | "stopped" | Error) => {
      off();
      opts.signal?.removeEventListener("abort", onAbort);
      if (v instanceof Error) reject(v);
      else resolve(v);
    };
    const onAbort = () => finish(new Aborted(opts.signal?.reason));
    opts.signal?.addEventListener("abort", onAbort, { once: true });
    const check = () => void over().then((yes) => yes && finish(r.stopped ? "stopped" : "decided"), finish);
    off = gate.client.onEvent((e) => {
      if (e.run !== run) return;
      if (e.event === "cancelled" || e.event === "closed") finish("stopped");
      else if (e.event === "decided" || e.event === "expired" || e.event === "resumed") check();
    });
    // Subscribed first, then looked: a decision made before is seen by the look, after by an event.
    gate.watch(run, {}).then(check, finish);
  });
}

/** Continues a paused thread after the operator decided (`Command({ resume })`). */
export function resume(gate: Estop, graph: Invokable, config: RunnableConfig): Promise<unknown> {
  return invoke(gate, graph, new Command({ resume: { estop: "decided" } satisfies Record<string, Json> }), config);
}

/** The explicit stop of the thread's run (fences it and its sub-runs at the gate). */
export function cancel(gate: Estop, config: RunnableConfig, reason?: string): Promise<unknown> {
  return threadRun(gate, config as Config).cancel(reason);
}
