// The failure classes, measured the same way for every framework (the TypeScript twin of
// clients/python/tests/scenarios/common.py). A scenario is `(t: Trial) => Promise<number>`: the
// effects that leaked in one trial, `t.guarded` false for the framework alone, true for the same
// agent through its estop adapter against a real gate.
//
// * sibling        — a parallel sibling's email sent while an approval of the same turn was
//                    pending (the sibling works SIBLING_WORK_MS first; the human decides
//                    DECIDE_AFTER_MS after the request; with estop an operator rejects).
// * reject         — the human rejects a transfer; the model re-plans and reaches the same
//                    transfer through another tool nobody flagged (with estop both are the
//                    effect `wire_money` at the gate, and a rejected call stays rejected).
// * replay         — one logical charge done twice after a crash (LangGraph: a node re-run on
//                    resume; elsewhere the worker dies after the charge and the job is redelivered).
// * cancel_blocking — the user presses stop while a tool is in flight; its API call outlasts
//                    that (the tool goes on once the stop is pressed), then it blocks the event
//                    loop (sync work: it cannot see a signal) and writes.
// * cancel_async   — the same for an async tool whose write does not listen to the signal.
// * interrupt_continue — not a leak but the opposite failure: after an interrupt (the caller's
//                    AbortSignal) the conversation's next turn cannot do its effect (counted 1).
//
// The stop is the framework's own abort without estop and `run.cancel()` with it (the explicit
// stop; an abort is an interrupt there). A leak is a write that lands after the stop was pressed.
import { randomUUID } from "node:crypto";
import { performance } from "node:perf_hooks";
import { setTimeout as sleep } from "node:timers/promises";
import type { Estop, Run } from "../../src/index.js";
import type { Daemon } from "../../src/testing.js";

export const CLASSES = ["sibling", "reject", "replay", "cancel_blocking", "cancel_async", "interrupt_continue"] as const;
export type Klass = (typeof CLASSES)[number];

export const SIBLING_WORK_MS = 20;
export const DECIDE_AFTER_MS = 60;
export const TOOL_DELAY_MS = 30;

/** The outside world: what actually happened, and when (monotonic ms). */
export class World {
  readonly landed: Array<{ at: number; what: string }> = [];
  readonly marks = new Map<string, number>();
  do(what: string): void {
    this.landed.push({ at: performance.now(), what });
  }
  mark(name: string): void {
    this.marks.set(name, performance.now());
  }
  count(what: string, w: { after?: string; before?: string } = {}): number {
    const after = w.after === undefined ? -Infinity : (this.marks.get(w.after) ?? Infinity);
    const before = w.before === undefined ? Infinity : (this.marks.get(w.before) ?? Infinity);
    return this.landed.filter((l) => l.what === what && l.at > after && l.at < before).length;
  }
}

export interface Trial {
  daemon: Daemon;
  gate: Estop;
  world: World;
  runId: string;
  guarded: boolean;
}

export function newTrial(daemon: Daemon, gate: Estop, guarded: boolean): Trial {
  return { daemon, gate, world: new World(), runId: `leak-${randomUUID().slice(0, 10)}`, guarded };
}

/** Blocks the event loop (a sync SDK call, CPU work): nothing else runs meanwhile. */
export function blockFor(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

/**
 * The underlying API calls a tool makes. Without estop they act at once; with it each is a
 * gated effect of the current run (the documented integration: tools gated by the adapter, the
 * API calls they make wrapped with `gate.effect`), so a stopped run refuses them even mid-tool.
 */
export function api(t: Trial) {
  const raw = {
    email: async (_: { to: string }) => void t.world.do("email"),
    transfer: async (_: { to: string; amount: number }) => void t.world.do("wire"),
    charge: async (_: { amount: number }) => void t.world.do("charge"),
    refund: async (_: { amount: number }) => void t.world.do("refund"),
  };
  if (!t.guarded) return raw;
  return {
    email: t.gate.effect(raw.email, { tool: "send_email" }),
    transfer: t.gate.effect(raw.transfer, { tool: "wire_money" }),
    charge: t.gate.effect(raw.charge, { tool: "charge" }),
    refund: t.gate.effect(raw.refund, { tool: "refund" }),
  };
}

/** Swallows a refusal (what a tool that catches its API's errors does); anything else throws. */
export async function quietly(p: Promise<unknown>): Promise<void> {
  try {
    await p;
  } catch (e) {
    if (!(e instanceof Error) || !("reason" in e)) throw e;
  }
}

/**
 * The operator (with estop): subscribes to the run now; the returned promise waits for the run's
 * first approval hold of `tool`, lets DECIDE_AFTER_MS pass (the human reading it), marks
 * `decided` and decides.
 */
export async function arm(t: Trial, tool: string, decision: "approve" | "reject"): Promise<{ done: Promise<void> }> {
  const op = t.daemon.operator;
  let off = () => {};
  const held = new Promise<string>((resolve) => {
    off = op.onEvent((e) => {
      if (e.run === t.runId && e.event === "held" && e.reason === "approval" && String(e.key).includes(`:${tool}`)) resolve(String(e.key));
    });
  });
  await op.subscribe(t.runId);
  // Wrapped: an async function returning a bare promise would wait for it.
  const done = (async () => {
    const key = await held;
    off();
    await sleep(DECIDE_AFTER_MS);
    t.world.mark("decided");
    await op.decide(t.runId, key, decision);
    await op.unsubscribe(t.runId);
  })();
  return { done };
}

/** Resolves once `flag()` is true, checking after every turn of the event loop (no sleeps). */
export async function until(flag: () => boolean): Promise<void> {
  while (!flag()) await new Promise((r) => setImmediate(r));
}

/** A scenario that did not do what it sets out to do is broken, not leak-free: say so. */
export function expect(cond: boolean, what: string): void {
  if (!cond) throw new Error(`scenario broken: ${what}`);
}

export type Scenario = (t: Trial) => Promise<number>;
export type Scenarios = Record<Klass, Scenario>;
export type { Run };
