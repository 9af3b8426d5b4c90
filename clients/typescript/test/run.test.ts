// Runs and the effect wrapper against a real gate: the two-phase flow, holds decided by the
// operator, refusals by reason, receipts instead of a second run, sub-runs, stable keys, the
// watcher aborting the run's controllers the moment the gate stops it — and interrupts (the
// caller's AbortSignal, a hold timeout, a client timeout) that leave the run usable.
import assert from "node:assert/strict";
import { once } from "node:events";
import { test } from "node:test";
import { Aborted, Denied, EstopTimeout, HeldForApproval, NoRun, Rejected, RunStopped, deriveKey, digest } from "../src/index.js";
import { daemonPerFile, nextEvent, runId } from "./helpers.js";

const daemon = daemonPerFile();

/** Resolves with the key of `run`'s effect held for approval, once the operator sees it. */
async function heldKey(run: string): Promise<string> {
  const op = daemon.get().operator;
  const ev = nextEvent(op.onEvent.bind(op), (e) => e.run === run && e.event === "held" && e.reason === "approval");
  await op.subscribe(run);
  // Held before the subscription took: the inbox has it (after it, the event does).
  const [p] = await op.pending(run).catch(() => []);
  return p ? String(p.key) : String((await ev).key);
}

test("admitted: runs once, completed ok with its result; a replay returns the receipt", async () => {
  const g = daemon.get().gate();
  const id = runId();
  let calls = 0;
  const charge = g.effect(async ({ amount }: { amount: number }) => ({ charged: amount, n: ++calls }), { tool: "charge" });
  const first = await g.run(id).enter(() => charge({ amount: 10 }));
  assert.deepEqual(first, { charged: 10, n: 1 });
  // A crashed worker replays the run from the start: same run, same step, same call → same key.
  const again = await g.run(id).enter(() => charge({ amount: 10 }));
  assert.deepEqual(again, { charged: 10, n: 1 });
  assert.equal(calls, 1);
  const rep = await g.run(id).report();
  assert.equal((rep.done as unknown[]).length, 1);
});

test("held for approval: waits, the operator approves, it runs once", async () => {
  const d = daemon.get();
  const g = d.gate();
  const run = g.run(runId());
  let ran = 0;
  const p = run.effect({ tool: "wire_money", args: { amount: 7 } }, () => ++ran);
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
  const key = await heldKey(run.id);
  assert.equal(ran, 0);
  await d.operator.approve(run.id, key);
  assert.equal(await p, 1);
});

test("rejected: Rejected, the function never runs, and the same call stays rejected", async () => {
  const d = daemon.get();
  const run = d.gate().run(runId());
  const p = run.effect({ tool: "wire_money", args: { amount: 9 } }, () => assert.fail("ran"));
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
  await d.operator.reject(run.id, await heldKey(run.id));
  await assert.rejects(p, (e: unknown) => e instanceof Rejected && e.reason === "rejected");
  await assert.rejects(run.effect({ tool: "wire_money", args: { amount: 9 }, step: "re-plan" }, () => assert.fail("ran")), Rejected);
  await assert.rejects(run.effect({ tool: "forbidden_tool", args: {} }, () => assert.fail("ran")), Denied);
});

test("onHold raise: HeldForApproval carries the hold (adapters turn it into the framework's pause)", async () => {
  const run = daemon.get().gate().run(runId());
  const e = await run.effect({ tool: "wire_money", args: {}, onHold: "raise" }, () => 1).catch((x: unknown) => x);
  assert.ok(e instanceof HeldForApproval);
  assert.equal(e.held.reason, "approval");
  assert.equal((await run.status()).state, "active");
});

test("an interrupt is not a cancel: caller abort and hold timeout leave the run and its hold usable", async () => {
  const d = daemon.get();
  const g = d.gate();
  const run = g.run(runId());
  const ac = new AbortController();
  // The same call (one call id) three times: interrupted while held, timed out while held, then
  // approved and run. The hold outlives each interruption; nothing is cancelled.
  const call = { tool: "wire_money", args: { amount: 1 }, callId: "call_1" };
  const p = run.effect({ ...call, signal: ac.signal }, () => assert.fail("ran"));
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
  const key = await heldKey(run.id);
  ac.abort();
  await assert.rejects(p, Aborted);
  await assert.rejects(run.effect({ ...call, holdTimeoutMs: 50 }, () => 0), EstopTimeout);
  assert.equal(run.stopped, undefined);
  assert.equal(run.signal.aborted, false);
  assert.equal((await run.status()).state, "active");
  await d.operator.approve(run.id, key);
  assert.equal(await run.effect(call, () => "sent"), "sent");
});

test("the watcher: an operator cancel aborts the run's signal and controllers at once; a tool in flight is unknown", async () => {
  const d = daemon.get();
  const g = d.gate();
  const run = g.run(runId());
  const extra = new AbortController();
  run.track(extra);
  let began!: () => void;
  const started = new Promise<void>((r) => (began = r));
  const p = run.effect({ tool: "slow_upload", args: {} }, async (signal) => {
    began();
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
    await once(signal, "abort");
    throw signal.reason;
  });
  await started;
  await d.operator.cancel(run.id, "operator stop");
  await assert.rejects(p, RunStopped);
  assert.ok(extra.signal.aborted);
  await assert.rejects(run.effect({ tool: "send_email", args: {} }, () => assert.fail("ran")), (e: unknown) => e instanceof RunStopped && e.local);
  const rep = await d.operator.report(run.id);
  assert.deepEqual((rep.unknown as Array<{ tool: string }>).map((x) => x.tool), ["slow_upload"]);
});

test("run.cancel() is the explicit stop: fenced locally first, then at the gate with its sub-runs", async () => {
  const d = daemon.get();
  const g = d.gate();
  const parent = g.run(runId());
  const child = parent.child("research");
  assert.equal(child.id, `${parent.id}.research`);
  await parent.effect({ tool: "lookup_a", args: {} }, () => 1);
  await child.effect({ tool: "lookup_b", args: {} }, () => 2);
  assert.equal((await child.status()).parent, parent.id);
  const childAborted = once(child.signal, "abort");
  const res = await parent.cancel("user pressed stop");
  await childAborted;
  assert.deepEqual([...(res?.runs as string[])].sort(), [child.id, parent.id].sort());
  assert.equal((await d.operator.status(child.id)).state, "cancelled");
  // Another process (a fresh handle) is refused by the gate itself.
  const other = d.gate().run(child.id, { parent: parent.id });
  await assert.rejects(other.effect({ tool: "send_email", args: {} }, () => assert.fail("ran")), (e: unknown) => e instanceof RunStopped && !e.local);
});

test("stable keys: occurrences within a step are counted, call ids give the key", async () => {
  const g = daemon.get().gate();
  const id = runId();
  let n = 0;
  const send = () => ++n;
  const run = g.run(id);
  // Three identical calls at one named step are three effects (not collapsed to one).
  for (let i = 0; i < 3; i++) await run.effect({ tool: "send_sms", args: { to: "1" }, step: "notify" }, send);
  assert.equal(n, 3);
  // A replay (a new Run object for the same id) presents the same three keys: receipts.
  const replay = g.run(id);
  for (let i = 0; i < 3; i++) await replay.effect({ tool: "send_sms", args: { to: "1" }, step: "notify" }, send);
  assert.equal(n, 3);
  assert.equal(deriveKey(id, "notify", "send_sms", digest("send_sms", { to: "1" }), 2).split(":").slice(0, 3).join(":"), "notify:send_sms:2");
  // A framework call id is the key: other arguments on a retry of the same call are a mismatch,
  // never a second effect.
  await run.effect({ tool: "charge", args: { amount: 5 }, callId: "call_abc" }, send);
  await assert.rejects(run.effect({ tool: "charge", args: { amount: 6 }, callId: "call_abc" }, send), (e: unknown) => e instanceof Error && /mismatch/.test(e.message));
  assert.equal(n, 4);
});

test("outside a run, a wrapped effect says so", async () => {
  const g = daemon.get().gate();
  await assert.rejects(g.effect(() => 1, { tool: "x" })(undefined), NoRun);
});

test("a paused run holds the start; resume lets the same token go", async () => {
  const d = daemon.get();
  const run = d.gate().run(runId());
  await run.effect({ tool: "lookup_a", args: {} }, () => 1);
  await d.operator.pause(run.id);
  const events: string[] = [];
  const off = d.operator.onEvent((e) => void events.push(e.event));
  await d.operator.subscribe(run.id);
  const p = run.effect({ tool: "send_email", args: {} }, () => "sent");
  p.catch(() => {}); // it may settle before the operator's reply does; asserted below
  await nextEvent(d.operator.onEvent.bind(d.operator), (e) => e.run === run.id && e.event === "held");
  await d.operator.resume(run.id);
  assert.equal(await p, "sent");
  off();
});

test("a run that stops or closes gives its subscription back (the gate bounds them)", async () => {
  const d = daemon.get();
  const g = d.gate();
  const a = g.run(runId());
  const b = g.run(runId());
  await a.effect({ tool: "lookup_a", args: {} }, () => 1);
  await b.effect({ tool: "lookup_b", args: {} }, () => 1);
  assert.deepEqual(g.client.subscribed().sort(), [a.id, b.id].sort());
  await a.close();
  const stopped = once(b.signal, "abort");
  await d.operator.cancel(b.id);
  await stopped;
  assert.deepEqual(g.client.subscribed(), []);
});
