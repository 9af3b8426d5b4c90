// The protocol v1 client: one connection (Unix socket or TCP), `hello` first, requests pipelined
// and matched to replies by id (a long `wait` never holds up other calls), events handed to
// listeners, and a reconnect with backoff that says `hello` again, re-subscribes and re-sends the
// requests whose replies were lost (every agent verb is idempotent at the gate; `decide` and
// `token` are not, so those are never re-sent).
import { connect as netConnect, type Socket } from "node:net";
import { setTimeout as sleep } from "node:timers/promises";
import { resolveConfig, type Config, type Endpoint } from "./config.js";
import { Aborted, ConnectionLost, EstopError, EstopTimeout, InvalidRequest, ProtocolViolation, Unauthenticated, errorFromReply } from "./errors.js";
import { digest, type Json } from "./jcs.js";
import { parseVerdict, type Verdict } from "./verdicts.js";

/** The gate's default `line_bytes_max` (docs/PROTOCOL.md, "Limits"). */
export const LINE_BYTES_MAX = 65536;
/** The longest reply line this client reads by default: a 64 KiB result, escaped, fits well. */
export const REPLY_BYTES_MAX = 1 << 20;

const IDEMPOTENT = new Set([
  "hello", "ping", "admit", "start", "complete", "wait", "subscribe", "unsubscribe", "status",
  "cancel", "close", "runs", "pending", "report", "ledger", "pause", "resume", "kill",
  // A repeated executor registration or report answers the same and records nothing.
  "compensations", "compensated", "looked_up",
]);

export interface ClientOptions extends Endpoint {
  /** Per-call reply timeout (a `wait` gets its own timeout on top). Default 30 s. */
  timeoutMs?: number;
  connectTimeoutMs?: number;
  /** Connection attempts per call before `ConnectionLost`; also re-sends per lost reply. Default 6. */
  reconnectAttempts?: number;
  backoffInitialMs?: number;
  backoffMaxMs?: number;
  /** The gate's `line_bytes_max`: a longer request is refused here, before it is sent. */
  lineBytesMax?: number;
  /** The longest reply line read; a longer one ends the connection with `ProtocolViolation`. */
  replyBytesMax?: number;
}

export interface CallOptions {
  /** Aborting interrupts this call only (`Aborted`); the gate may still have applied it. */
  signal?: AbortSignal | undefined;
  timeoutMs?: number | undefined;
}

export type GateEvent = { event: string; run: string; at?: number; key?: string; reason?: string; decision?: string; outcome?: string } & Record<string, unknown>;
export type EventListener = (event: GateEvent) => void;

export interface AdmitOptions extends CallOptions {
  args?: unknown;
  digest?: string | undefined;
  start?: boolean;
  parent?: string | undefined;
  labels?: Record<string, string> | undefined;
  needsApproval?: boolean | undefined;
  limits?: RunLimits | undefined;
  /** How the call is undone, in the client's own words; it may only add to policy's. */
  declare?: Declare | undefined;
  /**
   * What this call may cost at worst, counted against the model budget (`max_spend` /
   * `max_tokens`) of the run and every ancestor until `complete` settles it with its `cost`
   * (docs/PROTOCOL.md, "Model budget").
   */
  reserve?: Spend | undefined;
}

/** A run's limits, applied when the first admit creates it (`max_spend` in micro-USD). */
export interface RunLimits {
  deadline_ms?: number;
  timeout_ms?: number;
  max_effects?: number;
  max_spend?: number;
  max_tokens?: number;
}

/** Model spend: `usd_micros` and `tokens`, whole numbers from 0 to 10^12. */
export interface Spend { usd_micros?: number; tokens?: number }

const SPEND_MAX = 1e12;

/** A `reserve` or `cost` as the wire takes it; anything else throws before the wire. */
function spendField(name: string, v: Spend | undefined): Spend | undefined {
  if (v === undefined) return undefined;
  if (typeof v !== "object" || v === null || Array.isArray(v)) throw new TypeError(`${name} must be an object with usd_micros and/or tokens`);
  const out: Spend = {};
  for (const [k, n] of Object.entries(v)) {
    if (k !== "usd_micros" && k !== "tokens") throw new TypeError(`${name} has ${JSON.stringify(k)}; only usd_micros and tokens are counted`);
    if (typeof n !== "number" || !Number.isInteger(n) || n < 0 || n > SPEND_MAX) throw new RangeError(`${name}.${k} must be a whole number from 0 to 10^12, not ${String(n)}`);
    out[k] = n;
  }
  return Object.keys(out).length ? out : undefined;
}

/** A client's declaration of how a call is undone (`admit.declare`, docs/PROTOCOL.md). */
export interface Declare {
  reversibility?: "reversible" | "compensable" | "irreversible" | "undeclared";
  /** The compensating tool. */
  compensate?: string;
  /** CEL building the compensating call's arguments from `args` and `result` (docs/POLICY.md). */
  compensate_args?: string;
}

type Reply = Record<string, unknown>;
interface Pending { resolve: (r: Reply) => void; reject: (e: unknown) => void }

/** One socket: line framing with a bound, replies by id, events out. */
class Conn {
  readonly pending = new Map<number, Pending>();
  alive = true;
  private chunks: Buffer[] = [];
  private buffered = 0;

  constructor(readonly socket: Socket, private readonly replyBytesMax: number, private readonly onEvent: (e: GateEvent) => void, private readonly onClose: (c: Conn) => void) {
    socket.on("data", (d: Buffer) => this.data(d));
    socket.on("error", (e) => this.close(new ConnectionLost(`connection to the gate lost: ${e.message}`, { cause: e })));
    socket.on("close", () => this.close(new ConnectionLost("the gate closed the connection")));
  }

  private data(d: Buffer): void {
    let start = 0;
    for (let nl = d.indexOf(10); nl !== -1 && this.alive; nl = d.indexOf(10, start)) {
      const part = d.subarray(start, nl);
      const line = this.chunks.length ? Buffer.concat([...this.chunks, part]) : part;
      this.chunks = [];
      this.buffered = 0;
      start = nl + 1;
      if (line.length > this.replyBytesMax) return this.violate(line.length);
      this.line(line);
    }
    if (!this.alive || start >= d.length) return;
    const rest = d.subarray(start);
    this.buffered += rest.length;
    // A line is never buffered past the bound, however slowly or hugely the peer sends it.
    if (this.buffered > this.replyBytesMax) return this.violate(this.buffered);
    this.chunks.push(rest);
  }

  private violate(bytes: number): void {
    this.chunks = [];
    this.close(new ProtocolViolation(`the gate sent a line of ${bytes}+ bytes, over replyBytesMax ${this.replyBytesMax}; connection dropped`));
  }

  private line(line: Buffer): void {
    const text = line.toString("utf8").trim();
    if (!text) return;
    let msg: unknown;
    try {
      msg = JSON.parse(text);
    } catch {
      return this.close(new ProtocolViolation(`the gate sent a line that is not JSON: ${text.slice(0, 120)}`));
    }
    if (msg === null || typeof msg !== "object" || Array.isArray(msg)) return;
    const m = msg as Reply;
    if (typeof m.event === "string" && !("id" in m)) return this.onEvent(m as GateEvent);
    if (typeof m.id !== "number") return; // an unasked error line (the gate closes after it)
    const p = this.pending.get(m.id);
    if (p) {
      this.pending.delete(m.id);
      p.resolve(m);
    }
  }

  send(id: number, line: string, p: Pending): void {
    if (!this.alive) throw new ConnectionLost("connection to the gate is closed");
    this.pending.set(id, p);
    this.socket.write(line);
  }

  close(err: EstopError): void {
    if (!this.alive) return;
    this.alive = false;
    const waiting = [...this.pending.values()];
    this.pending.clear();
    this.socket.destroy();
    this.onClose(this);
    for (const p of waiting) p.reject(err);
  }
}

/** Resolves when `signal` aborts (with `Aborted`); never resolves otherwise. */
function abortPromise(signal: AbortSignal | undefined): { promise: Promise<never>; dispose: () => void } {
  if (!signal) return { promise: new Promise<never>(() => {}), dispose: () => {} };
  let dispose = () => {};
  const promise = new Promise<never>((_, reject) => {
    if (signal.aborted) return reject(new Aborted(signal.reason));
    const on = () => reject(new Aborted(signal.reason));
    signal.addEventListener("abort", on, { once: true });
    dispose = () => signal.removeEventListener("abort", on);
  });
  promise.catch(() => {});
  return { promise, dispose };
}

export class Client {
  readonly config: Config;
  readonly timeoutMs: number;
  readonly connectTimeoutMs: number;
  readonly reconnectAttempts: number;
  readonly backoffInitialMs: number;
  readonly backoffMaxMs: number;
  readonly lineBytesMax: number;
  readonly replyBytesMax: number;
  role: string | undefined;
  principal: string | undefined;
  /** How many connections were made (1 + reconnects); tests and operators read it. */
  connections = 0;
  private nextId = 1;
  private conn: Conn | undefined;
  private connecting: Promise<Conn> | undefined;
  private closed = false;
  private readonly subs = new Map<string, number>();
  /** The runs this connection is an executor of ("" for every run), said again after a reconnect. */
  private readonly executes = new Set<string>();
  private readonly listeners = new Set<EventListener>();
  private readonly reconnectListeners = new Set<() => void>();

  constructor(opts: ClientOptions = {}) {
    this.config = resolveConfig(opts);
    this.timeoutMs = opts.timeoutMs ?? 30_000;
    this.connectTimeoutMs = opts.connectTimeoutMs ?? 5_000;
    this.reconnectAttempts = Math.max(1, opts.reconnectAttempts ?? 6);
    this.backoffInitialMs = opts.backoffInitialMs ?? 50;
    this.backoffMaxMs = opts.backoffMaxMs ?? 2_000;
    this.lineBytesMax = opts.lineBytesMax ?? LINE_BYTES_MAX;
    this.replyBytesMax = opts.replyBytesMax ?? REPLY_BYTES_MAX;
    if (!this.config.socket && this.config.port === undefined) {
      throw new EstopError("no_gate", "no gate address: pass socket or addr, or set ESTOP_SOCKET, ESTOP_ADDR or ESTOP_DATA");
    }
  }

  /** Where this client dials, for messages. */
  get where(): string {
    return this.config.socket ?? `${this.config.host}:${this.config.port}`;
  }

  /** Calls `fn(event)` for every event line (after `subscribe`); keep it short. */
  onEvent(fn: EventListener): () => void {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  /** Calls `fn()` after every reconnect (the subscriptions are back; events in the gap were lost). */
  onReconnect(fn: () => void): () => void {
    this.reconnectListeners.add(fn);
    return () => this.reconnectListeners.delete(fn);
  }

  private dispatch(e: GateEvent): void {
    for (const fn of this.listeners) {
      try {
        fn(e);
      } catch (err) {
        process.emitWarning(`estop: an event listener threw: ${String(err)}`, "EstopWarning");
      }
    }
  }

  private async dial(): Promise<Socket> {
    const c = this.config;
    const socket = c.socket ? netConnect({ path: c.socket }) : netConnect({ host: c.host ?? "127.0.0.1", port: c.port ?? 0 });
    socket.setNoDelay(true);
    return new Promise<Socket>((resolve, reject) => {
      const timer = setTimeout(() => {
        socket.destroy();
        reject(new ConnectionLost(`no connection to ${this.where} within ${this.connectTimeoutMs} ms`));
      }, this.connectTimeoutMs);
      socket.once("connect", () => {
        clearTimeout(timer);
        socket.removeAllListeners("error");
        resolve(socket);
      });
      socket.once("error", (e) => {
        clearTimeout(timer);
        reject(new ConnectionLost(`cannot reach the gate at ${this.where}: ${e.message}`, { cause: e }));
      });
    });
  }

  private async connection(signal?: AbortSignal): Promise<Conn> {
    if (this.conn?.alive) return this.conn;
    if (this.closed) throw new ConnectionLost("client is closed");
    this.connecting ??= this.reconnect().finally(() => (this.connecting = undefined));
    const abort = abortPromise(signal);
    try {
      return await Promise.race([this.connecting, abort.promise]);
    } finally {
      abort.dispose();
    }
  }

  private async reconnect(): Promise<Conn> {
    let delay = this.backoffInitialMs;
    let last: unknown;
    for (let attempt = 0; attempt < this.reconnectAttempts; attempt++) {
      if (attempt) {
        await sleep(delay * (0.5 + Math.random() / 2));
        delay = Math.min(delay * 2, this.backoffMaxMs);
      }
      if (this.closed) throw new ConnectionLost("client is closed");
      let conn: Conn;
      try {
        const socket = await this.dial();
        conn = new Conn(socket, this.replyBytesMax, (e) => this.dispatch(e), (c) => {
          if (this.conn === c) this.conn = undefined;
        });
      } catch (e) {
        last = e;
        continue;
      }
      try {
        await this.handshake(conn);
      } catch (e) {
        conn.close(new ConnectionLost("handshake failed"));
        if (!(e instanceof ConnectionLost) && !(e instanceof EstopTimeout)) throw e; // a bad token stays bad
        last = e;
        continue;
      }
      this.conn = conn;
      if (this.connections++ > 0) for (const fn of this.reconnectListeners) fn();
      return conn;
    }
    throw new ConnectionLost(`cannot reach the gate at ${this.where} after ${this.reconnectAttempts} attempts: ${last instanceof Error ? last.message : String(last)}`, { cause: last });
  }

  private async handshake(conn: Conn): Promise<void> {
    if (!this.config.token) throw new Unauthenticated("unauthenticated", "no token: pass token, or set ESTOP_TOKEN, ESTOP_TOKEN_FILE or ESTOP_DATA");
    const hello = check(await this.roundtrip(conn, "hello", { token: this.config.token }, { timeoutMs: this.connectTimeoutMs }));
    if (hello.protocol !== 1) throw new ProtocolViolation(`the gate speaks protocol ${String(hello.protocol)}, this client protocol 1`);
    this.role = typeof hello.role === "string" ? hello.role : undefined;
    this.principal = typeof hello.principal === "string" ? hello.principal : undefined;
    for (const run of this.subs.keys()) {
      check(await this.roundtrip(conn, "subscribe", { run }, { timeoutMs: this.connectTimeoutMs }));
    }
    for (const run of this.executes) {
      check(await this.roundtrip(conn, "compensations", run ? { run } : {}, { timeoutMs: this.connectTimeoutMs }));
    }
  }

  private roundtrip(conn: Conn, op: string, fields: Record<string, unknown>, opts: CallOptions): Promise<Reply> {
    const id = this.nextId++;
    const line = `${JSON.stringify({ id, op, ...fields })}\n`;
    const bytes = Buffer.byteLength(line) - 1;
    if (bytes > this.lineBytesMax) {
      return Promise.reject(new InvalidRequest("line_too_long", `${op} request is ${bytes} bytes, over line_bytes_max ${this.lineBytesMax}`));
    }
    const timeoutMs = opts.timeoutMs ?? this.timeoutMs;
    return new Promise<Reply>((resolve, reject) => {
      const signal = opts.signal;
      const done = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        conn.pending.delete(id);
      };
      const onAbort = () => {
        done();
        reject(new Aborted(signal?.reason));
      };
      const timer = setTimeout(() => {
        done();
        reject(new EstopTimeout(`no reply to ${op} from ${this.where} within ${timeoutMs} ms`));
      }, timeoutMs);
      if (signal?.aborted) return onAbort();
      signal?.addEventListener("abort", onAbort, { once: true });
      try {
        conn.send(id, line, { resolve: (r) => (done(), resolve(r)), reject: (e) => (done(), reject(e)) });
      } catch (e) {
        done();
        reject(e);
      }
    });
  }

  /** One request; the reply's fields (`ok: false` throws the typed GateError). */
  async call(op: string, fields: Record<string, unknown> = {}, opts: CallOptions = {}): Promise<Reply> {
    const retries = IDEMPOTENT.has(op) ? this.reconnectAttempts : 0;
    for (let attempt = 0; ; attempt++) {
      if (opts.signal?.aborted) throw new Aborted(opts.signal.reason);
      const conn = await this.connection(opts.signal);
      try {
        return check(await this.roundtrip(conn, op, fields, opts));
      } catch (e) {
        if (e instanceof ConnectionLost && attempt < retries && !this.closed) continue;
        throw e;
      }
    }
  }

  async connect(opts: CallOptions = {}): Promise<this> {
    await this.connection(opts.signal);
    return this;
  }

  /** Closes the connection; pending calls end with `ConnectionLost`. */
  close(): void {
    this.closed = true;
    this.conn?.close(new ConnectionLost("client closed"));
  }

  /** Drops the current connection as if the network failed (tests; a client reconnects). */
  dropConnection(): void {
    this.conn?.close(new ConnectionLost("connection dropped"));
  }

  // -- agent verbs ----------------------------------------------------------------------------

  async hello(opts: CallOptions = {}): Promise<{ role: string | undefined; principal: string | undefined }> {
    await this.connection(opts.signal);
    return { role: this.role, principal: this.principal };
  }

  async ping(opts: CallOptions = {}): Promise<boolean> {
    return (await this.call("ping", {}, opts)).pong === true;
  }

  async admit(run: string, key: string, tool: string, opts: AdmitOptions = {}): Promise<Verdict> {
    const f: Record<string, unknown> = { run, key, tool, start: opts.start ?? true };
    if (opts.digest !== undefined) f.digest = opts.digest;
    else f.args = opts.args === undefined ? null : opts.args;
    if (opts.parent !== undefined) f.parent = opts.parent;
    if (opts.labels && Object.keys(opts.labels).length) f.labels = opts.labels;
    if (opts.needsApproval) f.needs_approval = true;
    if (opts.limits && Object.keys(opts.limits).length) f.limits = opts.limits;
    if (opts.declare && Object.keys(opts.declare).length) f.declare = opts.declare;
    const reserve = spendField("reserve", opts.reserve);
    if (reserve) f.reserve = reserve;
    return parseVerdict(await this.call("admit", this.fitAdmit(f), opts));
  }

  /** Arguments that would make the line too long are sent as their digest (the gate binds to it). */
  private fitAdmit(f: Record<string, unknown>): Record<string, unknown> {
    if (!("args" in f) || Buffer.byteLength(JSON.stringify(f)) <= this.lineBytesMax - 64) return f;
    const { args, ...rest } = f;
    return { ...rest, digest: digest(f.tool as string, args) };
  }

  async start(run: string, key: string, token: string, opts: CallOptions = {}): Promise<Verdict> {
    return parseVerdict(await this.call("start", { run, key, token }, opts));
  }

  /** `detail.cost`: what the call cost; it releases the admission's `reserve` and is charged once up the tree. */
  async complete(run: string, key: string, token: string, outcome: "ok" | "error" | "unknown", detail: { result?: Json; error?: string; cost?: Spend } = {}, opts: CallOptions = {}): Promise<{ late: boolean }> {
    const f: Record<string, unknown> = { run, key, token, outcome };
    if ("result" in detail) f.result = detail.result;
    if (detail.error !== undefined) f.error = detail.error;
    const cost = spendField("cost", detail.cost);
    if (cost) f.cost = cost;
    return { late: (await this.call("complete", f, opts)).late === true };
  }

  /**
   * Blocks until the held effect is decided (or `timeoutMs` passes: `held` again). The client's
   * own timeout is `timeoutMs` plus the usual one, unless `opts.timeoutMs` says otherwise.
   */
  async wait(run: string, key: string, timeoutMs: number, opts: CallOptions = {}): Promise<Verdict> {
    const t = Math.max(1, Math.floor(timeoutMs));
    return parseVerdict(await this.call("wait", { run, key, timeout_ms: t }, { ...opts, timeoutMs: opts.timeoutMs ?? t + this.timeoutMs }));
  }

  /** Event lines for `run` and its descendants; kept across reconnects. */
  async subscribe(run: string, opts: CallOptions = {}): Promise<void> {
    await this.call("subscribe", { run }, opts);
    this.subs.set(run, (this.subs.get(run) ?? 0) + 1);
  }

  /** The runs this client is subscribed to (re-subscribed after a reconnect). */
  subscribed(): string[] {
    return [...this.subs.keys()];
  }

  async unsubscribe(run: string, opts: CallOptions = {}): Promise<void> {
    const n = this.subs.get(run) ?? 0;
    if (n > 1) return void this.subs.set(run, n - 1);
    this.subs.delete(run);
    await this.call("unsubscribe", { run }, opts);
  }

  /**
   * Makes this connection an executor of the reverse saga (of `run`, or of every run the
   * principal sees): `compensate` and `lookup` events reach the listeners; report each with
   * `compensated` / `lookedUp`. Said again after a reconnect.
   */
  async compensations(run?: string, opts: CallOptions = {}): Promise<void> {
    await this.call("compensations", run === undefined ? {} : { run }, opts);
    this.executes.add(run ?? "");
  }

  /** How attempt `attempt` of the compensation of `(run, key)` ended. */
  compensated(run: string, key: string, attempt: number, outcome: "ok" | "error" | "unknown", error?: string, opts: CallOptions = {}): Promise<Reply> {
    const f: Record<string, unknown> = { run, key, attempt, outcome };
    if (error !== undefined) f.error = error;
    return this.call("compensated", f, opts);
  }

  /** What lookup `attempt` of an unknown outcome found: `ok` (with its result), `error` (not found), `unknown`. */
  lookedUp(run: string, key: string, attempt: number, outcome: "ok" | "error" | "unknown", detail: { result?: Json; error?: string } = {}, opts: CallOptions = {}): Promise<Reply> {
    const f: Record<string, unknown> = { run, key, attempt, outcome };
    if ("result" in detail) f.result = detail.result;
    if (detail.error !== undefined) f.error = detail.error;
    return this.call("looked_up", f, opts);
  }

  status(run: string, opts: CallOptions = {}): Promise<Reply> {
    return this.call("status", { run }, opts);
  }

  cancel(run: string, reason?: string, opts: CallOptions = {}): Promise<Reply> {
    return this.call("cancel", reason === undefined ? { run } : { run, reason }, opts);
  }

  closeRun(run: string, outcome?: "completed" | "failed", opts: CallOptions = {}): Promise<Reply> {
    return this.call("close", outcome === undefined ? { run } : { run, outcome }, opts);
  }

  /** Every page of a listing, its `lists` appended (docs/PROTOCOL.md, "Pages"). */
  private async pages(op: string, lists: string[], fields: Record<string, unknown>, opts: CallOptions): Promise<Reply> {
    let acc: Reply | undefined;
    let cursor: unknown;
    for (;;) {
      const page = await this.call(op, cursor === undefined ? fields : { ...fields, cursor }, opts);
      if (!acc) acc = { ...page };
      else for (const k of lists) acc[k] = [...((acc[k] as unknown[]) ?? []), ...((page[k] as unknown[]) ?? [])];
      cursor = page.next;
      if (typeof cursor !== "string" || !cursor) {
        delete acc.more;
        delete acc.next;
        return acc;
      }
    }
  }

  async runs(state?: string, opts: CallOptions = {}): Promise<Reply[]> {
    return ((await this.pages("runs", ["runs"], state ? { state } : {}, opts)).runs as Reply[]) ?? [];
  }

  async pending(run?: string, opts: CallOptions = {}): Promise<Reply[]> {
    return ((await this.pages("pending", ["pending"], run ? { run } : {}, opts)).pending as Reply[]) ?? [];
  }

  report(run: string, opts: CallOptions = {}): Promise<Reply> {
    return this.pages("report", ["done", "failed", "refused", "in_flight", "unknown", "compensable", "irreversible", "undeclared", "held"], { run }, opts);
  }

  // -- operator verbs -------------------------------------------------------------------------

  decide(run: string, key: string, decision: "approve" | "reject", reason?: string, opts: CallOptions = {}): Promise<Reply> {
    return this.call("decide", reason === undefined ? { run, key, decision } : { run, key, decision, reason }, opts);
  }
  approve(run: string, key: string, reason?: string, opts?: CallOptions): Promise<Reply> {
    return this.decide(run, key, "approve", reason, opts);
  }
  reject(run: string, key: string, reason?: string, opts?: CallOptions): Promise<Reply> {
    return this.decide(run, key, "reject", reason, opts);
  }
  pause(run: string, opts: CallOptions = {}): Promise<Reply> {
    return this.call("pause", { run }, opts);
  }
  resume(run: string, opts: CallOptions = {}): Promise<Reply> {
    return this.call("resume", { run }, opts);
  }
  kill(run: string, reason?: string, opts: CallOptions = {}): Promise<Reply> {
    return this.call("kill", reason === undefined ? { run } : { run, reason }, opts);
  }
  ledger(fields: { run?: string; limit?: number; after?: number } = {}, opts: CallOptions = {}): Promise<Reply> {
    return this.call("ledger", fields, opts);
  }
  async createToken(name: string, role: "agent" | "operator" | "observer", groups?: string[], opts: CallOptions = {}): Promise<string> {
    return String((await this.call("token", groups ? { name, role, groups } : { name, role }, opts)).token);
  }
  revokeToken(name: string, opts: CallOptions = {}): Promise<Reply> {
    return this.call("token_revoke", { name }, opts);
  }
  /** The operator's word on one effect of the reverse saga (docs/PROTOCOL.md, `saga`). */
  saga(run: string, key: string, action: "settle" | "retry" | "skip" | "compensate", fields: { outcome?: "ok" | "error"; result?: Json; reason?: string } = {}, opts: CallOptions = {}): Promise<Reply> {
    return this.call("saga", { run, key, action, ...fields }, opts);
  }
}

/** The verb's fields of an `ok: true` reply (without `id` and `ok`); the typed error otherwise. */
function check(reply: Reply): Reply {
  if (reply.ok !== true) throw errorFromReply(reply);
  const { id: _id, ok: _ok, ...fields } = reply;
  return fields;
}
