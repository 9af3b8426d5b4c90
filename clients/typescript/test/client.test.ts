// Protocol v1 against a real `estop serve`: hello over the socket and TCP, a bad token, pipelined
// requests (a long wait holds up nothing), a verdict of each kind, the typed errors, and
// AbortSignal / timeouts that interrupt one call and nothing else.
import assert from "node:assert/strict";
import { test } from "node:test";
import {
  Aborted, BadToken, Client, Conflict, EstopTimeout, Forbidden, InvalidRequest, NotFound, NotPending, Unauthenticated,
  type Verdict,
} from "../src/index.js";
import { daemonPerFile, runId } from "./helpers.js";

const daemon = daemonPerFile({ tcp: true });

function expectKind<K extends Verdict["kind"]>(v: Verdict, kind: K): Extract<Verdict, { kind: K }> {
  assert.equal(v.kind, kind, JSON.stringify(v));
  return v as Extract<Verdict, { kind: K }>;
}

test("hello over the Unix socket and over TCP", async () => {
  const d = daemon.get();
  assert.deepEqual(await d.client().hello(), { role: "agent", principal: "agent" });
  assert.ok(d.addr, "tcp listener");
  const tcp = d.client({ socket: undefined, addr: d.addr });
  assert.deepEqual(await new Client({ addr: d.addr, token: d.operatorToken }).hello().then((h) => h.role), "operator");
  assert.equal(await tcp.ping(), true);
  assert.equal(tcp.config.port, Number(d.addr.split(":")[1]));
});

test("a bad token is Unauthenticated at once, not retried into a ConnectionLost", async () => {
  const c = daemon.get().client({ token: "not-a-token", reconnectAttempts: 5 });
  await assert.rejects(c.status("x"), Unauthenticated);
  assert.equal(c.connections, 0);
  const none = daemon.get().client({ token: "" });
  await assert.rejects(none.ping(), /no token/);
});

test("a verdict of each kind, typed", async () => {
  const d = daemon.get();
  const c = d.client();
  const run = runId();
  const a = expectKind(await c.admit(run, "k-read", "lookup_user", { args: { id: 1 }, start: false }), "admitted");
  expectKind(await c.start(run, "k-read", a.token), "go");
  await c.complete(run, "k-read", a.token, "ok", { result: { name: "Ada" } });
  const dup = expectKind(await c.admit(run, "k-read", "lookup_user", { args: { id: 1 } }), "duplicate");
  assert.deepEqual([dup.status, dup.outcome, dup.result], ["completed", "ok", { name: "Ada" }]);
  assert.equal(expectKind(await c.admit(run, "k-read", "lookup_user", { args: { id: 2 } }), "refused").reason, "mismatch");
  assert.equal(expectKind(await c.admit(run, "k-deny", "forbidden_tool", { args: {} }), "refused").reason, "denied");
  const held = expectKind(await c.admit(run, "k-wire", "wire_money", { args: { amount: 5 } }), "held");
  assert.equal(held.reason, "approval");
  assert.ok(held.approval && held.expiresAt);
  assert.equal(expectKind(await c.admit(run, "k-email", "send_email", { args: {} }), "held").reason, "sibling");
  await d.operator.reject(run, "k-wire");
  assert.equal(expectKind(await c.wait(run, "k-wire", 1000), "refused").reason, "rejected");
  const run2 = runId();
  await c.admit(run2, "k0", "lookup_user", { args: {} });
  await d.operator.pause(run2);
  assert.equal(expectKind(await c.admit(run2, "k1", "send_email", { args: {} }), "held").reason, "paused");
  await c.cancel(run2, "stop");
  assert.equal(expectKind(await c.admit(run2, "k2", "send_email", { args: {} }), "refused").reason, "cancelled");
});

test("typed gate errors by code", async () => {
  const d = daemon.get();
  const c = d.client();
  const run = runId();
  await assert.rejects(c.approve(run, "k"), Forbidden);
  await assert.rejects(c.status(run), NotFound);
  const a = expectKind(await c.admit(run, "k", "send_email", { args: {}, start: false }), "admitted");
  await assert.rejects(c.start(run, "k", "9.999"), BadToken);
  await assert.rejects(c.complete(run, "k", a.token, "ok"), Conflict); // never started
  await assert.rejects(d.operator.approve(run, "k"), NotPending);
  const e = await c.call("frobnicate").catch((x: unknown) => x);
  assert.ok(e instanceof InvalidRequest && e.code === "unknown_op", String(e));
});

test("the model budget: reserve on admit, cost on complete, a refusal naming the parent's limit, status's spend", async () => {
  const c = daemon.get().client();
  const parent = runId();
  const [a, b] = [`${parent}/a`, `${parent}/b`];
  expectKind(await c.admit(parent, "plan", "lookup_plan", { args: {}, limits: { max_spend: 1000 } }), "admitted");
  const va = expectKind(await c.admit(a, "m1", "model.call", { args: {}, start: false, parent, reserve: { usd_micros: 600 } }), "admitted");
  const vb = expectKind(await c.admit(b, "m1", "model.call", { args: {}, parent, reserve: { usd_micros: 600 } }), "refused");
  assert.equal(vb.reason, "budget");
  assert.deepEqual(vb.budget, { dimension: "model_usd", run: parent, limit: 1000, used: 600 });
  expectKind(await c.start(a, "m1", va.token), "go");
  await c.complete(a, "m1", va.token, "ok", { result: {}, cost: { usd_micros: 1000, tokens: 7 } });
  const s = await c.status(parent);
  assert.equal(s.cause, "budget", JSON.stringify(s));
  const lines = s.budget as { dimension: string; spent: number; reserved: number; limit?: number }[];
  assert.deepEqual(lines.find((l) => l.dimension === "model_usd"), { dimension: "model_usd", spent: 1000, reserved: 0, limit: 1000 });
  assert.equal(lines.find((l) => l.dimension === "model_tokens")?.spent, 7);
  // Bad spend never reaches the wire.
  for (const bad of [{ usd: 1 }, { tokens: -1 }, { tokens: 1e12 + 1 }, { tokens: 1.5 }]) {
    await assert.rejects(c.admit(b, "m2", "model.call", { args: {}, reserve: bad as never }), /reserve/);
  }
});

test("an oversize request: refused before sending, and the gate's own line_too_long when sent", async () => {
  const d = daemon.get();
  const c = d.client();
  const big = "x".repeat(70_000);
  await assert.rejects(c.call("status", { run: big }), (e: unknown) => e instanceof InvalidRequest && e.code === "line_too_long");
  // Arguments too big for a line go as their digest: the gate binds to it all the same.
  const run = runId();
  expectKind(await c.admit(run, "big", "upload", { args: { blob: big } }), "admitted");
  // A client told the gate's bound is larger sends the line; the gate answers line_too_long
  // (id null) and the connection stays usable, so this call times out and the next one works.
  const loose = d.client({ lineBytesMax: 1 << 20, timeoutMs: 500 });
  await assert.rejects(loose.call("status", { run: big }), EstopTimeout);
  assert.equal(await loose.ping(), true);
});

test("pipelined: a long wait holds up nothing on the same connection", async () => {
  const d = daemon.get();
  const c = d.client();
  const run = runId();
  expectKind(await c.admit(run, "w", "wire_money", { args: { amount: 1 } }), "held");
  const waiting = c.wait(run, "w", 60_000);
  const others = await Promise.all(Array.from({ length: 50 }, (_, i) => c.admit(runId(), `k${i}`, "lookup_x", { args: { i } })));
  assert.ok(others.every((v) => v.kind === "admitted"));
  assert.equal(c.connections, 1);
  await d.operator.approve(run, "w");
  expectKind(await waiting, "admitted");
});

test("an AbortSignal interrupts the call only: the hold stays, the run goes on", async () => {
  const d = daemon.get();
  const c = d.client();
  const run = runId();
  expectKind(await c.admit(run, "w", "wire_money", { args: {} }), "held");
  const ac = new AbortController();
  const waiting = c.wait(run, "w", 60_000, { signal: ac.signal });
  ac.abort(new Error("user closed the tab"));
  await assert.rejects(waiting, (e: unknown) => e instanceof Aborted && /user closed the tab/.test(e.message));
  await assert.rejects(c.ping({ signal: AbortSignal.abort() }), Aborted);
  const st = await c.status(run);
  assert.equal(st.state, "active");
  assert.equal((st.effects as Record<string, number>).held, 1);
  // A client timeout is the same kind of interruption.
  await assert.rejects(c.wait(run, "w", 5_000, { timeoutMs: 1 }), EstopTimeout);
  assert.equal((await c.status(run)).state, "active");
});
