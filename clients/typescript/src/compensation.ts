// The reverse saga's executor on the client side (docs/PROTOCOL.md, "compensations"): after a
// cancel, the gate offers each completed compensable effect's undo, newest first, and asks
// declared lookups about unknown outcomes first. A `CompensationWorker` runs the handler
// registered for the tool named and reports how it ended. It keeps a connection of its own, so it
// goes on while the agent that was cancelled stops:
//
//   const worker = new CompensationWorker({
//     refund_charge: async (args, idempotencyKey) => stripe.refunds.create({ ...args, idempotency_key: idempotencyKey }),
//     find_charge: async (args, idempotencyKey) => (await stripe.charges.search(idempotencyKey)) ?? null,
//   });
//   await worker.serve(signal);  // until the signal aborts
//
// Pass `idempotencyKey` to the system the handler reaches: an attempt that landed but was not
// reported (a crash, a lost connection) is offered again with the same key. A compensation
// handler that returns reports `ok`; one that throws reports `error` (retried by the gate with
// backoff, then a human is asked); `CompensationUnknown` reports `unknown` (a human is asked at
// once). A lookup handler returns what the call returned if it happened (`ok`, recorded as its
// result) or `null`/`undefined` if it did not (`error`: nothing to undo); a throw reports
// `unknown` (an operator settles it). A tool with no handler is reported `error`/`unknown` saying so.
import { Client, type ClientOptions, type GateEvent } from "./client.js";
import { EstopError } from "./errors.js";
import { toJson, type Json } from "./jcs.js";

const ERROR_BYTES_MAX = 4_000;

/** `handler(args, idempotencyKey, signal)`: a compensation, or a lookup (see the module comment). */
export type CompensationHandler = (args: unknown, idempotencyKey: string, signal: AbortSignal) => Promise<unknown> | unknown;

/** Thrown by a handler that cannot tell whether its compensation took effect. */
export class CompensationUnknown extends EstopError {
  constructor(message = "the handler could not tell whether it took effect") {
    super("compensation_unknown", message);
  }
}

export interface CompensationWorkerOptions {
  /** Only this run's compensations (default: every run the token's principal sees). */
  run?: string;
  /** A client of its own (default: one from `clientOptions` or the environment). */
  client?: Client;
  clientOptions?: ClientOptions;
}

/** One report the worker made: (run, key, attempt, what it ran, outcome). */
export interface Reported {
  run: string;
  key: string;
  attempt: number;
  kind: "compensate" | "lookup";
  outcome: "ok" | "error" | "unknown";
}

function errorText(e: unknown): string {
  const s = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
  return Buffer.from(s, "utf8").subarray(0, ERROR_BYTES_MAX).toString("utf8").replace(/\uFFFD$/u, "");
}

export class CompensationWorker {
  readonly client: Client;
  readonly run: string | undefined;
  /** Every report made, in order. */
  readonly reported: Reported[] = [];
  private readonly handlers: Map<string, CompensationHandler>;
  private readonly queue: GateEvent[] = [];
  private wake: (() => void) | undefined;
  private off: (() => void) | undefined;

  constructor(handlers: Record<string, CompensationHandler>, opts: CompensationWorkerOptions = {}) {
    this.handlers = new Map(Object.entries(handlers));
    this.run = opts.run;
    this.client = opts.client ?? new Client(opts.clientOptions);
  }

  /** Registers as an executor; `compensate` and `lookup` events queue from then on. */
  async start(): Promise<this> {
    if (this.off) return this;
    this.off = this.client.onEvent((e) => {
      if ((e.event === "compensate" || e.event === "lookup") && (this.run === undefined || e.run === this.run)) {
        this.queue.push(e);
        this.wake?.();
      }
    });
    await this.client.compensations(this.run);
    return this;
  }

  /** The next offered event (waits for one; `undefined` once `signal` aborts). */
  async next(signal?: AbortSignal): Promise<GateEvent | undefined> {
    while (!this.queue.length) {
      if (signal?.aborted) return undefined;
      await new Promise<void>((resolve) => {
        this.wake = resolve;
        signal?.addEventListener("abort", () => resolve(), { once: true });
      });
      this.wake = undefined;
    }
    return this.queue.shift();
  }

  /** Runs what the gate offers until `signal` aborts, then closes the client. */
  async serve(signal?: AbortSignal): Promise<void> {
    await this.start();
    try {
      for (;;) {
        const e = await this.next(signal);
        if (!e) return;
        await this.runOne(e, signal);
      }
    } finally {
      this.close();
    }
  }

  /** Runs one offered compensation or lookup and reports it; returns the outcome reported. */
  async runOne(e: GateEvent, signal: AbortSignal = new AbortController().signal): Promise<"ok" | "error" | "unknown"> {
    const run = e.run;
    const key = String(e.key);
    const attempt = Number(e.attempt);
    const tool = typeof e.tool === "string" ? e.tool : "";
    const idem = String(e.idempotency_key);
    const kind = e.event === "lookup" ? "lookup" : "compensate";
    const handler = this.handlers.get(tool);
    let outcome: "ok" | "error" | "unknown";
    let error: string | undefined;
    let result: Json | undefined;
    if (!handler) {
      // A missing lookup cannot tell; a missing undo is an error the gate retries, then a human.
      outcome = kind === "lookup" ? "unknown" : "error";
      error = `no handler for ${JSON.stringify(tool)} in this worker (it has ${JSON.stringify([...this.handlers.keys()].sort())})`;
    } else {
      try {
        const value = await handler(e.args, idem, signal);
        if (kind === "lookup" && (value === null || value === undefined)) outcome = "error";
        else {
          outcome = "ok";
          if (kind === "lookup") result = toJson(value);
        }
      } catch (err) {
        outcome = kind === "lookup" || err instanceof CompensationUnknown ? "unknown" : "error";
        error = errorText(err);
      }
    }
    if (error !== undefined) process.emitWarning(`estop: ${kind} ${tool} of ${run}/${key} attempt ${attempt}: ${outcome}: ${error}`, "EstopWarning");
    if (kind === "lookup") {
      const detail: { result?: Json; error?: string } = {};
      if (result !== undefined) detail.result = result;
      if (error !== undefined) detail.error = error;
      await this.client.lookedUp(run, key, attempt, outcome, detail);
    } else {
      await this.client.compensated(run, key, attempt, outcome, error);
    }
    this.reported.push({ run, key, attempt, kind, outcome });
    return outcome;
  }

  close(): void {
    this.off?.();
    this.off = undefined;
    this.client.close();
  }
}
