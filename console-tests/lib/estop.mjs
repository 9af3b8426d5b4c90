// Test support: starts a real `estop serve` on a temp data dir with the console on a free port,
// waits for its ready line (never sleeps), and speaks protocol v1 over its Unix socket as an agent.
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync, readFileSync, rmSync, existsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve, dirname } from "node:path";
import { createConnection } from "node:net";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const here = dirname(fileURLToPath(import.meta.url));
export const repo = resolve(here, "..", "..");

export const POLICY = `
[defaults]
unknown_tool = "approve"
approval_expiry = "10m"

[[rules]]
tool = "refund"
action = "approve"
reversibility = "compensable"
compensate = "reverse_refund"

[[rules]]
tool = "wire"
action = "approve"
quorum = 2

[[rules]]
tool = "pay"
action = "allow"
reversibility = "irreversible"

[[rules]]
tool = "send_email"
action = "allow"
`;

export function estopBin() {
  if (process.env.ESTOP_BIN) return process.env.ESTOP_BIN;
  const target = process.env.CARGO_TARGET_DIR || join(repo, "target");
  return join(target, "debug", "estop");
}

export async function startDaemon({ policy = POLICY, args = [] } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "estop-console-"));
  writeFileSync(join(dir, "policy.toml"), policy);
  const child = spawn(estopBin(), ["serve", "--data", dir, "--policy", join(dir, "policy.toml"), "--console", "127.0.0.1:0", ...args], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  const log = [];
  createInterface({ input: child.stderr }).on("line", (l) => log.push(l));
  const lines = createInterface({ input: child.stdout });
  const ready = await new Promise((res, rej) => {
    const found = {};
    const timer = setTimeout(() => rej(new Error("estop serve did not become ready:\n" + log.join("\n"))), 60000);
    lines.on("line", (l) => {
      if (l.startsWith("estop ready ")) found.ready = l;
      if (l.startsWith("estop console ")) found.console = l;
      if (found.ready && found.console) { clearTimeout(timer); res(found); }
    });
    child.on("exit", (code) => { clearTimeout(timer); rej(new Error(`estop serve exited ${code}:\n` + log.join("\n"))); });
  });
  const field = (k) => ready.ready.split(" ").find((w) => w.startsWith(k + "="))?.slice(k.length + 1);
  const console = field("console");
  return {
    dir, child, log,
    base: "http://" + console,
    // stdout is no terminal here: the one-time link is in DATA/console-login (mode 0600).
    loginLink: existsSync(join(dir, "console-login")) ? readFileSync(join(dir, "console-login"), "utf8").trim() : ready.console.split(" ")[2],
    consoleLine: ready.console,
    socket: field("socket"),
    operatorToken: readFileSync(join(dir, "operator.token"), "utf8").trim(),
    agentToken: readFileSync(join(dir, "agent.token"), "utf8").trim(),
    async stop() {
      child.kill("SIGTERM");
      await new Promise((r) => child.once("exit", r));
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** A protocol v1 client over the daemon's Unix socket (replies matched by id). */
export async function connect(socket, token) {
  const sock = createConnection(socket);
  await new Promise((res, rej) => { sock.once("connect", res); sock.once("error", rej); });
  const waiting = new Map();
  let next = 1;
  // Events (lines without an id: `subscribe`, an executor's `compensate`) queue here.
  const events = [];
  const eventWaiters = [];
  createInterface({ input: sock }).on("line", (line) => {
    const msg = JSON.parse(line);
    if (msg.id !== undefined && waiting.has(msg.id)) { waiting.get(msg.id)(msg); waiting.delete(msg.id); return; }
    if (msg.event !== undefined) {
      const w = eventWaiters.findIndex(([pred]) => pred(msg));
      if (w >= 0) eventWaiters.splice(w, 1)[0][1](msg); else events.push(msg);
    }
  });
  /** The first event `pred` accepts, queued or to come. */
  const nextEvent = (pred, ms = 30000) => {
    const i = events.findIndex(pred);
    if (i >= 0) return Promise.resolve(events.splice(i, 1)[0]);
    return new Promise((res, rej) => {
      const t = setTimeout(() => rej(new Error("no such event within " + ms + " ms; have " + JSON.stringify(events))), ms);
      eventWaiters.push([pred, (m) => { clearTimeout(t); res(m); }]);
    });
  };
  const call = (req) => new Promise((res) => {
    const id = next++;
    waiting.set(id, res);
    sock.write(JSON.stringify({ id, ...req }) + "\n");
  });
  const hello = await call({ op: "hello", token });
  if (!hello.ok) throw new Error("hello failed: " + JSON.stringify(hello));
  return { call, nextEvent, events, close: () => sock.end() };
}

export async function launch() {
  const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";
  const browser = await chromium.launch({
    executablePath,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync"],
  });
  // playwright-core gives every launch a fresh, temporary --user-data-dir of its own.
  return { browser, close: () => browser.close() };
}
