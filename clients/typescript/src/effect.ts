// An effect admitted by the gate first, two-phase: admit (start=false) → while held, wait →
// start (the commit point, checked at the instant of execution) → run → complete ok / error /
// unknown. A duplicate returns the recorded result without running; a refusal throws `Refused`
// (by reason) and the function never runs.
import type { CallOptions, Declare } from "./client.js";
import { Aborted, EffectFailed, EstopTimeout, HeldForApproval, InDoubt, NoRun, RunStopped, refusal } from "./errors.js";
import { digest as digestOf, toJson, type Json } from "./jcs.js";
import { callKey, deriveKey } from "./keys.js";
import type { Estop, Run } from "./run.js";
import type { Duplicate, Held, Verdict } from "./verdicts.js";

const RESULT_BYTES_MAX = 60_000;
const ERROR_BYTES_MAX = 4_000;
const WAIT_CHUNK_MS = 30_000;
/** How long a completion may take to reach the gate after the effect ran (it is retried). */
const COMPLETE_TIMEOUT_MS = 30_000;

export interface EffectOptions {
  /** The tool name policy matches on. */
  tool: string;
  /** The call's arguments (JSON): the gate binds approvals and receipts to their digest. */
  args?: unknown;
  /** The key, verbatim (an id you keep stable yourself). */
  key?: string | undefined;
  /** The framework's call id (tool_call_id, callId): the key is derived from it alone. */
  callId?: string | undefined;
  /** The logical step (default "run"): keys are step + tool + digest + occurrence in the step. */
  step?: string | undefined;
  /** Ask for approval even where policy allows (an agent can strengthen policy, never weaken). */
  needsApproval?: boolean | undefined;
  /** "wait" (default): wait for the decision. "raise": throw HeldForApproval (adapters pause). */
  onHold?: "wait" | "raise";
  /** Give up waiting for a decision after this long (`EstopTimeout`; the run goes on). */
  holdTimeoutMs?: number | undefined;
  /** The caller's signal: interrupts this call only (`Aborted`), never cancels the run. */
  signal?: AbortSignal | undefined;
  /** The tool that undoes this one (run by a `CompensationWorker` after a cancel). */
  compensate?: string | undefined;
  /** CEL building the undo's arguments from `args` and `result`, e.g. `{"charge": result.id}`. */
  compensateArgs?: string | undefined;
}

/** The declaration an effect's options make (`undefined`: none). */
function declared(opts: EffectOptions): Declare | undefined {
  if (opts.compensate === undefined && opts.compensateArgs === undefined) return undefined;
  const d: Declare = {};
  if (opts.compensate !== undefined) d.compensate = opts.compensate;
  if (opts.compensateArgs !== undefined) d.compensate_args = opts.compensateArgs;
  return d;
}

/** What the gate said: run it now (`token`), or the recorded outcome (`duplicate`). */
export type Gated = { token: string; key: string } | { duplicate: Duplicate; key: string };

/** The key an effect gets (see EffectOptions). */
export function effectKey(run: Run, opts: EffectOptions): string {
  if (opts.key !== undefined) return opts.key;
  if (opts.callId !== undefined) return callKey(opts.tool, opts.callId);
  const d = digestOf(opts.tool, toJson(opts.args ?? null));
  const scope = run.gate.currentStep();
  if (opts.step === undefined && scope) return deriveKey(run.id, scope.name, opts.tool, d, scope.occurrence(opts.tool, d));
  const step = opts.step ?? "run";
  return deriveKey(run.id, step, opts.tool, d, run.occurrence(step, opts.tool, d));
}

/** A signal that fires when the run stops or the caller aborts, and which of the two it was. */
function combined(run: Run, signal: AbortSignal | undefined): AbortSignal {
  return signal ? AbortSignal.any([run.signal, signal]) : run.signal;
}

/** Turns an abort of the combined signal into the right error: the run's stop or the caller's. */
function whyAborted(run: Run, e: unknown, tool: string, key: string): unknown {
  if (e instanceof Aborted && run.signal.aborted) return new RunStopped(run.stopped ?? "cancelled", { run: run.id, tool, key }, true);
  return e;
}

/** Asks the gate until the effect may run now, is a duplicate, or is refused (throws). */
export async function gate(run: Run, opts: EffectOptions, key: string = effectKey(run, opts)): Promise<Gated> {
  const { tool } = opts;
  run.check(tool, key);
  const client = run.gate.client;
  const call: CallOptions = { signal: combined(run, opts.signal) };
  const deadline = opts.holdTimeoutMs === undefined ? undefined : Date.now() + opts.holdTimeoutMs;
  try {
    let v: Verdict = await client.admit(run.id, key, tool, {
      ...call,
      args: toJson(opts.args ?? null),
      start: false,
      parent: run.parent?.id,
      labels: run.labels,
      limits: run.limits,
      needsApproval: opts.needsApproval,
      declare: declared(opts),
    });
    run.created = true;
    await run.gate.watch(run.id, call);
    for (;;) {
      switch (v.kind) {
        case "admitted": {
          run.check(tool, key);
          const s = await client.start(run.id, key, v.token, call);
          if (s.kind === "go") return { token: v.token, key };
          if (s.kind === "held") {
            // A prepared effect held at start (sibling, pause): `wait` answers `admitted` with
            // the same token once start would go; then start again.
            v = await hold(run, key, tool, s, opts, deadline, call);
            continue;
          }
          v = s;
          continue;
        }
        case "held":
          v = await hold(run, key, tool, v, opts, deadline, call);
          continue;
        case "refused":
          throw refusal(v.reason, { run: run.id, key, tool }, v.message, v.rule);
        case "duplicate":
          if (v.status === "completed") return { duplicate: v, key };
          if (v.status === "failed") throw new EffectFailed(run.id, key, v.error);
          throw new InDoubt(run.id, key, v.status);
        case "go":
          throw new TypeError("the gate answered go to an admit");
      }
    }
  } catch (e) {
    throw whyAborted(run, e, tool, key);
  }
}

async function hold(run: Run, key: string, tool: string, held: Held, opts: EffectOptions, deadline: number | undefined, call: CallOptions): Promise<Verdict> {
  if ((opts.onHold ?? run.gate.currentStep()?.onHold) === "raise") throw new HeldForApproval(run.id, key, tool, held);
  run.check(tool, key);
  const left = deadline === undefined ? WAIT_CHUNK_MS : deadline - Date.now();
  if (left <= 0) throw new EstopTimeout(`${tool} in run ${JSON.stringify(run.id)} still held (${held.reason}) after ${opts.holdTimeoutMs} ms`);
  return run.gate.client.wait(run.id, key, Math.min(left, WAIT_CHUNK_MS), call);
}

function encodeResult(value: unknown): Json {
  let v: Json;
  try {
    v = toJson(value === undefined ? null : value);
  } catch {
    return { repr: String(value).slice(0, 1000) };
  }
  return Buffer.byteLength(JSON.stringify(v)) > RESULT_BYTES_MAX ? { truncated: true, repr: JSON.stringify(v).slice(0, 1000) } : v;
}

function errorText(e: unknown): string {
  const s = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
  return Buffer.from(s, "utf8").subarray(0, ERROR_BYTES_MAX).toString("utf8").replace(/\uFFFD$/u, "");
}

/**
 * Reports the outcome. A completion that cannot reach the gate (after the client's reconnects)
 * must not turn an effect that happened into a failure: it is reported as a warning and the
 * effect's result is kept (the gate shows the effect `started`, in doubt, until settled).
 */
async function report(run: Run, key: string, token: string, outcome: "ok" | "error" | "unknown", detail: { result?: Json; error?: string }): Promise<void> {
  try {
    await run.gate.client.complete(run.id, key, token, outcome, detail, { timeoutMs: COMPLETE_TIMEOUT_MS });
  } catch (e) {
    process.emitWarning(`estop: the completion (${outcome}) of ${key} in run ${run.id} did not reach the gate: ${String(e)}`, "EstopWarning");
  }
}

/** Gates `fn` and reports its outcome; see the module comment. */
export async function runEffect<T>(run: Run, opts: EffectOptions, fn: (signal: AbortSignal) => Promise<T> | T, decode?: (recorded: Json | undefined) => T): Promise<T> {
  const g = await gate(run, opts);
  if ("duplicate" in g) return decode ? decode(g.duplicate.result) : (g.duplicate.result as T);
  const signal = combined(run, opts.signal);
  let result: T;
  try {
    // The function runs in its run, as a step named by this effect's key: effects it makes
    // itself (an API call wrapped with gate.effect) get keys under it — the same on a retry or
    // a replay of this call, distinct from another call's.
    result = await run.enter(() => run.gate.step(g.key, () => fn(signal)));
  } catch (e) {
    // Interrupted after start (run stopped, caller aborted): nobody can tell whether it happened.
    await report(run, g.key, g.token, signal.aborted ? "unknown" : "error", { error: errorText(e) });
    throw e;
  }
  await report(run, g.key, g.token, "ok", { result: encodeResult(result) });
  return result;
}

export interface WrapOptions extends Omit<EffectOptions, "args" | "key" | "callId" | "signal"> {
  /** Fields of the input object left out of the effect's identity (a client, a callback). */
  exclude?: string[];
}

/** The call's identity: the input, minus `exclude` when it is an object. */
export function identityArgs(input: unknown, exclude: string[] | undefined): unknown {
  if (!exclude?.length || input === null || typeof input !== "object" || Array.isArray(input)) return input;
  return Object.fromEntries(Object.entries(input).filter(([k]) => !exclude.includes(k)));
}

/**
 * Makes `fn` (one input, as tools take) a gated effect of the run current when it is called
 * (`run.enter`): each call is admitted first, keyed by the input. `fn` also gets the signal that
 * fires when the run stops.
 */
export function wrap<I, T>(gateHandle: Estop, fn: (input: I, signal: AbortSignal) => Promise<T> | T, opts: WrapOptions): (input: I) => Promise<T> {
  return (input: I) => {
    const run = gateHandle.current();
    if (!run) return Promise.reject(new NoRun(`effect ${opts.tool}`));
    return runEffect(run, { ...opts, args: identityArgs(input, opts.exclude) }, (signal) => fn(input, signal));
  };
}
