// The reverse saga from TypeScript, against a real gate: an effect's `compensate` /
// `compensateArgs` declare how it is undone (admit's `declare`), and a `CompensationWorker` runs
// the undo the gate offers after a cancel — newest first, with arguments built from each call's
// result, the same idempotency key on every attempt — and answers a declared lookup of an unknown
// outcome before anything is undone, until the run is `cancelled`.
import assert from "node:assert/strict";
import { test } from "node:test";
import { CompensationUnknown, CompensationWorker } from "../src/index.js";
import { DEFAULT_POLICY } from "../src/testing.js";
import { daemonPerFile, runId } from "./helpers.js";

const daemon = daemonPerFile({
  policy: `${DEFAULT_POLICY}
[[rules]]
tool = "pay"
action = "allow"
compensate = "unpay"
compensate_args = '{"payment": result.id}'
lookup = "find_payment"
`,
});

/** Resolves once `run` is in `state` (polled: the worker acts on events of its own). */
async function until(run: string, state: string): Promise<void> {
  const op = daemon.get().operator;
  const deadline = Date.now() + 30_000;
  for (;;) {
    const s = await op.status(run);
    if (s.state === state) return;
    assert.ok(Date.now() < deadline, `run ${run} still ${String(s.state)}: ${JSON.stringify(await op.report(run))}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

test("a cancel runs the declared undos newest first, built from each result, and the run ends cancelled", async () => {
  const d = daemon.get();
  const g = d.gate();
  const id = runId("undo");
  const charge = g.effect(async ({ amount }: { amount: number }) => ({ id: `ch_${amount}` }), {
    tool: "charge",
    compensate: "refund_charge",
    compensateArgs: '{"charge": result.id, "amount": args.amount}',
  });
  const run = g.run(id);
  await run.enter(() => charge({ amount: 10 }));
  await run.enter(() => charge({ amount: 20 }));
  const undone: Array<[unknown, string]> = [];
  let fail = true;
  const worker = new CompensationWorker(
    {
      refund_charge: (args, key) => {
        undone.push([args, key]);
        // The first attempt fails: it is offered again, with the same key.
        if (fail) {
          fail = false;
          throw new Error("the payment provider timed out");
        }
      },
    },
    { run: id, client: d.client() },
  );
  await worker.start();
  await d.operator.cancel(id, "undo it");
  const stop = new AbortController();
  const serving = worker.serve(stop.signal);
  await until(id, "cancelled");
  stop.abort();
  await serving;
  assert.deepEqual(worker.reported.map((r) => [r.kind, r.outcome]), [["compensate", "error"], ["compensate", "ok"], ["compensate", "ok"]]);
  assert.deepEqual(undone.map(([a]) => a), [{ charge: "ch_20", amount: 20 }, { charge: "ch_20", amount: 20 }, { charge: "ch_10", amount: 10 }]);
  assert.equal(undone[0]![1], undone[1]![1], "a retry keeps the idempotency key");
  assert.ok(undone.every(([, k]) => k.endsWith("/undo")));
  g.close();
});

test("an unknown outcome is looked up first: found, it is undone with what the lookup returned", async () => {
  const d = daemon.get();
  const c = d.client();
  const id = runId("lookup");
  const v = await c.admit(id, "p1", "pay", { args: { amount: 5 } });
  assert.equal(v.kind, "admitted");
  if (v.kind !== "admitted") return;
  await c.complete(id, "p1", v.token, "unknown", { error: "the connection dropped" });
  const seen: string[] = [];
  const worker = new CompensationWorker(
    {
      find_payment: (args, key) => {
        seen.push(`find ${key} ${JSON.stringify(args)}`);
        return { id: "pay_7" };
      },
      unpay: (args) => void seen.push(`unpay ${JSON.stringify(args)}`),
    },
    { run: id, client: d.client() },
  );
  await worker.start();
  await d.operator.cancel(id);
  const stop = new AbortController();
  const serving = worker.serve(stop.signal);
  await until(id, "cancelled");
  stop.abort();
  await serving;
  assert.deepEqual(seen, ['find p1 {"amount":5}', 'unpay {"payment":"pay_7"}']);
  assert.deepEqual(worker.reported.map((r) => [r.kind, r.outcome]), [["lookup", "ok"], ["compensate", "ok"]]);
  c.close();
});

test("a lookup that finds nothing settles it as not happened; one that cannot tell leaves it to a human", async () => {
  const d = daemon.get();
  const c = d.client();
  const runs = [runId("none"), runId("unsure")];
  for (const id of runs) {
    const v = await c.admit(id, "p1", "pay", { args: { amount: 1 } });
    if (v.kind !== "admitted") throw new Error(JSON.stringify(v));
    await c.complete(id, "p1", v.token, "unknown");
  }
  const undone: unknown[] = [];
  const worker = new CompensationWorker(
    {
      find_payment: (_args, _key) => {
        if (worker.reported.length === 0) return null;
        throw new CompensationUnknown("the provider is down");
      },
      unpay: (args) => void undone.push(args),
    },
    { client: d.client() },
  );
  await worker.start();
  await d.operator.cancel(runs[0]!);
  assert.equal(await worker.runOne((await worker.next())!), "error");
  await until(runs[0]!, "cancelled");
  await d.operator.cancel(runs[1]!);
  assert.equal(await worker.runOne((await worker.next())!), "unknown");
  const rep = await d.operator.report(runs[1]!);
  assert.deepEqual(rep.saga_next, { key: "p1", waits: "settle" });
  assert.deepEqual(undone, [], "nothing undone that did not happen or is not known to have");
  worker.close();
  c.close();
});
