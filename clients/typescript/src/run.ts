// Runs: the gate handle, the current run (AsyncLocalStorage), sub-runs, the local fence and the
// watcher. A run subscribes to its events at its first admission; the moment the gate says the
// run (or an ancestor) stopped, the run is fenced locally — every later gate call of it throws
// `RunStopped` without asking — and its AbortControllers are aborted, so a tool in flight sees
// its signal fire. After a reconnect (events in the gap are lost) the watcher asks `status`.
//
// Interrupt is not cancel (seed 004): a caller's AbortSignal or a client timeout interrupts one
// call and leaves the run usable. Only `run.cancel()` (or an operator, a deadline, a budget)
// stops it.
import { AsyncLocalStorage } from "node:async_hooks";
import { randomUUID } from "node:crypto";
import { Client, type CallOptions, type ClientOptions, type GateEvent, type RunLimits } from "./client.js";
import { NoRun, NotFound, RunStopped } from "./errors.js";
import { runEffect, wrap, type EffectOptions, type WrapOptions } from "./effect.js";

const STOP_EVENTS = new Set(["cancelled", "finalizing", "closed"]);
const TERMINAL_STATES = new Set(["finalizing", "completed", "failed", "cancelled"]);
/** Stopped run ids remembered locally; the gate keeps the real fence, this only saves a trip. */
const STOPPED_REMEMBERED_MAX = 10_000;
/** Live-run entries past which dead ones are swept before adding another. */
const LIVE_SWEEP_AT = 4_096;

export interface RunOptions {
  /** The parent run (a sub-agent): a cancel of the parent reaches this run at the gate. */
  parent?: Run | string | undefined;
  /** Shown to operators (at most 16). */
  labels?: Record<string, string> | undefined;
  /** Apply when the first admit creates the run. */
  limits?: RunLimits | undefined;
}

export interface EstopOptions extends ClientOptions {
  /** A client to share (default: a new one from these options / the environment). */
  client?: Client;
}

/** A logical step (a graph node's execution, a tool call): effects inside are counted from 1. */
export class Step {
  private readonly counts = new Map<string, number>();
  constructor(readonly name: string, readonly onHold?: "wait" | "raise") {}
  /** The n-th identical call in this step (n from 1). */
  occurrence(tool: string, digest: string): number {
    const k = `${tool}\u0000${digest}`;
    const n = (this.counts.get(k) ?? 0) + 1;
    this.counts.set(k, n);
    return n;
  }
}

export class Estop {
  readonly client: Client;
  private readonly als = new AsyncLocalStorage<Run>();
  private readonly steps = new AsyncLocalStorage<Step>();
  private readonly stopped = new Map<string, string>();
  private readonly live = new Map<string, Set<WeakRef<Run>>>();
  private readonly watched = new Set<string>();

  constructor(opts: EstopOptions = {}) {
    this.client = opts.client ?? new Client(opts);
    this.client.onEvent((e) => this.onEvent(e));
    this.client.onReconnect(() => void this.recheck());
  }

  /**
   * A run (not yet entered). `id` defaults to ESTOP_RUN, else a fresh id; `parent` defaults to
   * the current run, so a run made inside another is its sub-run.
   */
  run(id?: string, opts: RunOptions = {}): Run {
    const cur = this.current();
    // The current run named again (a replay inside it) is that run, not its own child.
    const parent = opts.parent ?? (cur && cur.id === id ? cur.parent : cur);
    const rid = id ?? (parent ? undefined : this.client.config.run) ?? `run-${randomUUID().slice(0, 12)}`;
    return new Run(this, rid, parent, opts);
  }

  /** The run the calling async context is in (`run.enter`), if any. */
  current(): Run | undefined {
    return this.als.getStore();
  }

  /**
   * Runs `fn` as one logical step: effects inside without a key or call id get keys from the
   * step's name and their order within this execution — so a re-execution of the step (a
   * retry, a resume, a replay) presents the same keys, and the gate answers with receipts.
   */
  step<T>(name: string, fn: () => T, onHold?: "wait" | "raise"): T {
    return this.steps.run(new Step(name, onHold), fn);
  }

  /** The step the calling async context is in, if any. */
  currentStep(): Step | undefined {
    return this.steps.getStore();
  }

  /** @internal */
  enter<T>(run: Run, fn: () => T): T {
    return this.als.run(run, fn);
  }

  /** @internal Keeps the run findable by the watcher while it is referenced. */
  register(run: Run): void {
    if (this.live.size >= LIVE_SWEEP_AT) this.sweep();
    let set = this.live.get(run.id);
    if (!set) this.live.set(run.id, (set = new Set()));
    set.add(new WeakRef(run));
  }

  /** Drops the entries of runs nobody references any more. */
  private sweep(): void {
    for (const [id, refs] of this.live) {
      for (const ref of refs) if (!ref.deref()) refs.delete(ref);
      if (!refs.size) this.live.delete(id);
    }
  }

  /** Why the run (or an ancestor) is fenced locally, else undefined. */
  stopReason(run: Run): string | undefined {
    for (let r: Run | undefined = run; r; r = r.parent) {
      const why = this.stopped.get(r.id);
      if (why !== undefined) return why;
    }
    return undefined;
  }

  /** Fences `runId` locally and aborts the controllers of it and its local descendants. */
  fence(runId: string, reason: string): void {
    if (this.stopped.has(runId)) return;
    this.stopped.set(runId, reason);
    // A stopped run has nothing more to say: its subscription goes (the gate bounds them).
    if (this.watched.delete(runId)) this.client.unsubscribe(runId).catch(() => {});
    if (this.stopped.size > STOPPED_REMEMBERED_MAX) this.stopped.delete(this.stopped.keys().next().value as string);
    for (const [id, refs] of this.live) {
      for (const ref of refs) {
        const r = ref.deref();
        if (!r) refs.delete(ref);
        else if (r.descendsFrom(runId)) r.abortAll(reason);
      }
      if (!refs.size) this.live.delete(id);
    }
  }

  /** @internal Subscribes once per run id (at its first admission). */
  async watch(runId: string, opts: CallOptions): Promise<void> {
    if (this.watched.has(runId)) return;
    this.watched.add(runId);
    try {
      await this.client.subscribe(runId, opts);
    } catch (e) {
      this.watched.delete(runId);
      throw e;
    }
  }

  private onEvent(e: GateEvent): void {
    if (STOP_EVENTS.has(e.event) && typeof e.run === "string") {
      this.fence(e.run, e.event === "closed" ? "closed" : "cancelled");
    }
  }

  /** After a reconnect: a stop in the gap sent its event to the dead connection; ask. */
  private async recheck(): Promise<void> {
    for (const id of this.watched) {
      if (this.stopped.has(id)) continue;
      try {
        const st = await this.client.status(id);
        if (typeof st.state === "string" && TERMINAL_STATES.has(st.state)) this.fence(id, st.cause === "closed" ? "closed" : "cancelled");
      } catch {
        // unreachable again: the next reconnect asks again, and the gate refuses anyway
      }
    }
  }

  /**
   * Makes `fn` a gated effect of whichever run is current when it is called (`run.enter`):
   * `const refund = gate.effect(async ({ charge, amount }, signal) => ..., { tool: "refund" })`.
   */
  effect<I, T>(fn: (input: I, signal: AbortSignal) => Promise<T> | T, opts: WrapOptions): (input: I) => Promise<T> {
    return wrap(this, fn, opts);
  }

  close(): void {
    this.client.close();
  }
}

export class Run {
  readonly parent: Run | undefined;
  readonly labels: Record<string, string> | undefined;
  readonly limits: RunOptions["limits"];
  private readonly controller = new AbortController();
  private readonly controllers = new Set<AbortController>();
  private readonly occurrences = new Map<string, number>();
  /** @internal true once an admit of this run has been answered (parent, labels were sent). */
  created = false;

  constructor(readonly gate: Estop, readonly id: string, parent: Run | string | undefined, opts: RunOptions = {}) {
    this.parent = typeof parent === "string" ? new Run(gate, parent, undefined) : parent;
    this.labels = opts.labels;
    this.limits = opts.limits;
    gate.register(this);
    const why = gate.stopReason(this);
    if (why) this.controller.abort(new RunStopped(why, { run: id }, true));
  }

  /** Aborted the moment the run is stopped (locally or by the gate); never by an interrupt. */
  get signal(): AbortSignal {
    return this.controller.signal;
  }

  /** Why the run is fenced locally, else undefined. */
  get stopped(): string | undefined {
    return this.gate.stopReason(this);
  }

  /** Throws `RunStopped` (local) if the run is fenced. */
  check(tool?: string, key?: string): void {
    const why = this.stopped;
    if (why !== undefined) throw new RunStopped(why, { run: this.id, tool, key }, true);
  }

  /** A sub-agent's run, id `PARENT.name`: a cancel of this run reaches it at the gate. */
  child(name: string, opts: Omit<RunOptions, "parent"> = {}): Run {
    return new Run(this.gate, `${this.id}.${name}`, this, opts);
  }

  /** Runs `fn` with this run as the current run (effects inside use it). */
  enter<T>(fn: () => T): T {
    return this.gate.enter(this, fn);
  }

  /** Aborts `controller` when the run stops (returns the function that stops tracking it). */
  track(controller: AbortController): () => void {
    if (this.signal.aborted) controller.abort(this.signal.reason);
    this.controllers.add(controller);
    return () => this.controllers.delete(controller);
  }

  /** @internal */
  descendsFrom(runId: string): boolean {
    for (let r: Run | undefined = this; r; r = r.parent) if (r.id === runId) return true;
    return false;
  }

  /** @internal */
  abortAll(reason: string): void {
    const err = new RunStopped(reason, { run: this.id }, true);
    this.controller.abort(err);
    for (const c of this.controllers) c.abort(err);
    this.controllers.clear();
  }

  /** @internal The n-th identical call at `step` (n from 1), counted per run object. */
  occurrence(step: string, tool: string, digest: string): number {
    const k = JSON.stringify([step, tool, digest]);
    const n = (this.occurrences.get(k) ?? 0) + 1;
    this.occurrences.set(k, n);
    return n;
  }

  /**
   * Admits one effect and runs `fn` when the gate says go (see `runEffect`): the gate's
   * verdict decides whether `fn` runs at all; its signal fires when the run is stopped.
   */
  effect<T>(opts: EffectOptions, fn: (signal: AbortSignal) => Promise<T> | T): Promise<T> {
    return runEffect(this, opts, fn);
  }

  /**
   * Stops the run: fenced locally at once (nothing of it starts in this process while the
   * cancel travels), then at the gate, which fences every descendant. The explicit stop.
   */
  async cancel(reason?: string, opts: CallOptions = {}): Promise<Record<string, unknown> | undefined> {
    this.gate.fence(this.id, "cancelled");
    try {
      return await this.gate.client.cancel(this.id, reason, opts);
    } catch (e) {
      if (e instanceof NotFound) return undefined; // the gate never saw it; the local fence holds
      throw e;
    }
  }

  /** Ends the run normally (`completed`) or as `failed`; later admits are refused `closed`. */
  async close(outcome?: "completed" | "failed", opts: CallOptions = {}): Promise<Record<string, unknown> | undefined> {
    try {
      return await this.gate.client.closeRun(this.id, outcome, opts);
    } catch (e) {
      if (e instanceof NotFound) return undefined;
      throw e;
    } finally {
      this.gate.fence(this.id, "closed");
    }
  }

  status(opts: CallOptions = {}): Promise<Record<string, unknown>> {
    return this.gate.client.status(this.id, opts);
  }

  report(opts: CallOptions = {}): Promise<Record<string, unknown>> {
    return this.gate.client.report(this.id, opts);
  }
}

/** The current run of `gate`, or NoRun. */
export function requireRun(gate: Estop, what: string, run?: Run): Run {
  const r = run ?? gate.current();
  if (!r) throw new NoRun(what);
  return r;
}
