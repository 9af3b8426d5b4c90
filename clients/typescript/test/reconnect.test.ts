// The gate dies mid-wait and comes back on the same data directory: the wait is re-sent on a new
// connection (hello again, subscriptions again) and answers when the operator decides. A stop
// made while this client was disconnected is found by the watcher after the reconnect.
import assert from "node:assert/strict";
import { once } from "node:events";
import { test } from "node:test";
import { RunStopped } from "../src/index.js";
import { daemonPerFile, runId } from "./helpers.js";

const daemon = daemonPerFile();
const patient = { reconnectAttempts: 60, backoffInitialMs: 20, backoffMaxMs: 250 };

test("a gate that dies mid-wait: the wait is re-sent after the restart and gets the decision", async () => {
  const d = daemon.get();
  const c = d.client(patient);
  const run = runId();
  assert.equal((await c.admit(run, "w", "wire_money", { args: { amount: 3 } })).kind, "held");
  const waiting = c.wait(run, "w", 60_000);
  await d.kill();
  await d.boot();
  const op = d.client({ token: d.operatorToken, ...patient });
  await op.approve(run, "w"); // the hold survived the crash (G6)
  const v = await waiting;
  assert.equal(v.kind, "admitted");
  assert.ok(c.connections >= 2, `reconnected (${c.connections} connections)`);
});

test("subscriptions come back after a restart: a later cancel still aborts the run's signal", async () => {
  const d = daemon.get();
  const g = d.gate(patient);
  const run = g.run(runId());
  const controller = new AbortController();
  run.track(controller);
  await run.effect({ tool: "lookup_x", args: {} }, () => "ok");
  await d.kill();
  await d.boot();
  await g.client.ping(); // reconnected, hello'd and re-subscribed
  const aborted = once(controller.signal, "abort");
  await d.client({ token: d.operatorToken, ...patient }).cancel(run.id, "operator stop");
  await aborted;
  assert.ok(controller.signal.reason instanceof RunStopped);
  await assert.rejects(run.effect({ tool: "send_email", args: {} }, () => assert.fail("ran after the stop")), (e: unknown) => e instanceof RunStopped && e.local);
});

test("a stop while disconnected is found after the reconnect (its event went to the dead connection)", async () => {
  const d = daemon.get();
  const g = d.gate(patient);
  const run = g.run(runId());
  await run.effect({ tool: "lookup_x", args: {} }, () => "ok");
  g.client.dropConnection();
  await d.operator.cancel(run.id, "while you were away");
  const aborted = once(run.signal, "abort");
  await g.client.ping();
  await aborted;
  assert.equal(run.stopped, "cancelled");
});
