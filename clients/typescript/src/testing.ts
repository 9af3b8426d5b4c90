// A real `estop serve` on a temporary data directory, for tests, examples and demos:
//
//   const d = await Daemon.start();        // ESTOP_BIN, else target/debug/estop of this repo, else PATH
//   const gate = d.gate();                 // an agent-token Estop handle
//   await d.operator.approve(run, key);    // an operator-token Client
//   await d.stop();
//
// Readiness is the daemon's `estop ready …` line, never a sleep.
import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { delimiter, dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { Client, type ClientOptions } from "./client.js";
import { Estop, type EstopOptions } from "./run.js";

/** Approval-needing tools for demos and tests: anything named like a money movement. */
export const DEFAULT_POLICY = `
[defaults]
unknown_tool = "allow"
approval_expiry = "10m"

[[rules]]
tool = "lookup*"
action = "allow"
class = "read"

[[rules]]
tool = "wire_money"
action = "approve"
`;

/** The daemon binary: $ESTOP_BIN, else this repository's target/debug/estop, else `estop` on PATH. */
export function findBinary(): string {
  const env = process.env.ESTOP_BIN;
  if (env) return env;
  // dist/src/testing.js → clients/typescript → the repository root
  const repo = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");
  const built = join(process.env.CARGO_TARGET_DIR ?? join(repo, "target"), "debug", "estop");
  if (existsSync(built)) return built;
  for (const dir of (process.env.PATH ?? "").split(delimiter)) {
    if (dir && existsSync(join(dir, "estop"))) return join(dir, "estop");
  }
  throw new Error("no estop binary: set ESTOP_BIN, run `cargo build -p estop`, or put estop on PATH");
}

export interface DaemonOptions {
  /** Policy TOML (default DEFAULT_POLICY); null: none (every tool needs one approval). */
  policy?: string | null;
  /** Also listen on TCP (127.0.0.1, a free port). */
  tcp?: boolean;
  /** An existing data directory (a restart); default a fresh temp one, removed by `stop`. */
  data?: string;
  binary?: string;
  /** More `estop serve` options. */
  args?: string[];
  readyTimeoutMs?: number;
}

export class Daemon {
  proc: ChildProcess | undefined;
  ready: Record<string, string> = {};
  private op: Client | undefined;
  private readonly clients: Array<Client | Estop> = [];

  private constructor(readonly data: string, readonly opts: DaemonOptions, private readonly ownsData: boolean) {}

  static async start(opts: DaemonOptions = {}): Promise<Daemon> {
    const data = opts.data ?? mkdtempSync(join(tmpdir(), "estop-ts-"));
    const d = new Daemon(data, opts, opts.data === undefined);
    await d.boot();
    return d;
  }

  /** Starts the process (again, on the same data directory after `kill`). */
  async boot(): Promise<void> {
    const o = this.opts;
    const cmd = ["serve", "--data", this.data];
    if (o.policy !== null) {
      const pf = join(this.data, "policy.toml");
      writeFileSync(pf, o.policy ?? DEFAULT_POLICY);
      cmd.push("--policy", pf);
    }
    if (o.tcp) cmd.push("--listen", this.ready.tcp && this.ready.tcp !== "-" ? this.ready.tcp : "127.0.0.1:0");
    cmd.push("--console", "off", ...(o.args ?? []));
    const log = openSync(join(this.data, "daemon.log"), "a");
    const proc = spawn(o.binary ?? findBinary(), cmd, { stdio: ["ignore", "pipe", log] });
    this.proc = proc;
    const lines = createInterface({ input: proc.stdout! });
    const line = await new Promise<string>((resolveLine, reject) => {
      const timer = setTimeout(() => reject(new Error(`estop serve not ready within ${o.readyTimeoutMs ?? 60_000} ms; see ${join(this.data, "daemon.log")}`)), o.readyTimeoutMs ?? 60_000);
      lines.once("line", (l) => (clearTimeout(timer), resolveLine(l)));
      proc.once("exit", (code) => (clearTimeout(timer), reject(new Error(`estop serve exited (${code}) before ready; see ${join(this.data, "daemon.log")}`))));
    });
    if (!line.startsWith("estop ready")) throw new Error(`estop serve said ${JSON.stringify(line)} instead of ready`);
    this.ready = Object.fromEntries(line.split(/\s+/).slice(2).filter((kv) => kv.includes("=")).map((kv) => [kv.slice(0, kv.indexOf("=")), kv.slice(kv.indexOf("=") + 1)]));
    proc.stdout!.resume(); // keep draining: the daemon must never block on a full pipe
  }

  get socket(): string {
    return this.ready.socket ?? join(this.data, "estop.sock");
  }
  /** `host:port` of the TCP listener, if started with `tcp: true`. */
  get addr(): string | undefined {
    const t = this.ready.tcp;
    return t && t !== "-" ? t : undefined;
  }
  get agentToken(): string {
    return readFileSync(join(this.data, "agent.token"), "utf8").trim();
  }
  get operatorToken(): string {
    return readFileSync(join(this.data, "operator.token"), "utf8").trim();
  }

  /** A new agent-token client (closed by `stop`). */
  client(opts: ClientOptions = {}): Client {
    const c = new Client({ socket: this.socket, token: this.agentToken, ...opts });
    this.clients.push(c);
    return c;
  }

  /** A new agent-token gate handle (closed by `stop`). */
  gate(opts: EstopOptions = {}): Estop {
    const g = new Estop({ socket: this.socket, token: this.agentToken, ...opts });
    this.clients.push(g);
    return g;
  }

  /** The operator's client (one, shared). */
  get operator(): Client {
    this.op ??= this.client({ token: this.operatorToken });
    return this.op;
  }

  /** SIGKILL, as a crash (the data directory stays; `boot()` starts it again). */
  async kill(): Promise<void> {
    await this.signal("SIGKILL");
  }

  private async signal(sig: NodeJS.Signals): Promise<void> {
    const p = this.proc;
    if (!p || p.exitCode !== null || p.signalCode !== null) return;
    const exited = new Promise<void>((r) => p.once("exit", () => r()));
    p.kill(sig);
    await exited;
  }

  /** Closes the clients, stops the daemon and removes a data directory it made. */
  async stop(): Promise<void> {
    for (const c of this.clients) c.close();
    await this.signal("SIGTERM");
    if (this.ownsData) rmSync(this.data, { recursive: true, force: true });
  }
}
