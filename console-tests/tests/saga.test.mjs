// The report page's undo controls in headless Chromium against a real `estop serve`: an operator
// settles an unknown outcome with the result they found, retries an undo whose outcome was
// unknown, skips one with a reason, and compensates one effect of a killed run — each through
// the HTTP API with the tab's session and CSRF token — while an executor (protocol v1 over the
// Unix socket) runs what the gate offers. The executor sees each step's effect.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startDaemon, connect, launch } from "../lib/estop.mjs";

const POLICY = `
[[rules]]
tool = "refund"
action = "allow"
compensate = "reverse_refund"
compensate_args = '{"refund": result.id}'

[[rules]]
tool = "charge"
action = "allow"
compensate = "uncharge"
compensate_args = '{"charge": result.id}'
`;

let d, agent, executor, browser, closeBrowser;

before(async () => {
  d = await startDaemon({ policy: POLICY });
  agent = await connect(d.socket, d.agentToken);
  // The executor of every run the agent owns: it is offered their compensations.
  executor = await connect(d.socket, d.agentToken);
  assert.equal((await executor.call({ op: "compensations" })).ok, true);
  ({ browser, close: closeBrowser } = await launch());
});

after(async () => {
  agent?.close();
  executor?.close();
  await closeBrowser?.();
  await d?.stop();
});

async function loggedIn() {
  const context = await browser.newContext({ viewport: { width: 1200, height: 900 } });
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.errors = errors;
  const r = await fetch(d.base + "/api/v1/login-links", { method: "POST", headers: { Authorization: "Bearer " + d.operatorToken } });
  const { url } = await r.json();
  await page.goto(url);
  await page.waitForURL(d.base + "/");
  await page.waitForSelector("#live.on");
  return { page, context };
}

async function done(run, key, tool, result, outcome = "ok") {
  const v = await agent.call({ op: "admit", run, key, tool, args: { n: 1 } });
  assert.equal(v.verdict, "admitted", JSON.stringify(v));
  const c = await agent.call({ op: "complete", run, key, token: v.token, outcome, ...(result ? { result } : {}) });
  assert.equal(c.ok, true, JSON.stringify(c));
}

const offered = (run, key, attempt) => (e) => e.event === "compensate" && e.run === run && e.key === key && e.attempt === attempt;

async function report(run) {
  const r = await fetch(d.base + "/api/v1/runs/" + run + "/report", { headers: { Authorization: "Bearer " + d.operatorToken } });
  return r.json();
}

async function status(page, key) {
  return page.locator(`#saga tr[data-key="${key}"] .badge`).textContent();
}

test("settle, retry and skip a cancelled run's undo from the report page", async () => {
  const run = "saga-run";
  await done(run, "refund-1", "refund", { id: "re_1" });
  await done(run, "charge-2", "charge", null, "unknown");
  const stop = await fetch(d.base + "/api/v1/runs/" + run + "/cancel", { method: "POST", headers: { Authorization: "Bearer " + d.operatorToken } });
  assert.equal(stop.status, 200);
  const { page, context } = await loggedIn();
  await page.goto(d.base + "/#/runs/" + run);
  await page.waitForSelector("#saga");
  assert.match(await page.textContent("#saga-next"), /an operator to say whether charge-2 happened/);
  // The operator found the charge: it happened, with this id. The undo is built from it.
  await page.getByLabel("Result of charge-2").fill('{"id": "ch_2"}');
  await page.getByRole("button", { name: "It happened charge-2" }).click();
  const first = await executor.nextEvent(offered(run, "charge-2", 1));
  assert.deepEqual(first.args, { charge: "ch_2" });
  // Whether the uncharge landed is not known: a human is asked; the operator retries.
  assert.equal((await executor.call({ op: "compensated", run, key: "charge-2", attempt: 1, outcome: "unknown" })).status, "needs_human");
  await page.waitForFunction(() => /needs human/.test(document.querySelector('#saga tr[data-key="charge-2"]')?.textContent || ""));
  await page.getByRole("button", { name: "Retry charge-2" }).click();
  const second = await executor.nextEvent(offered(run, "charge-2", 2));
  assert.equal(second.idempotency_key, first.idempotency_key, "a retry keeps the key");
  assert.equal((await executor.call({ op: "compensated", run, key: "charge-2", attempt: 2, outcome: "ok" })).status, "compensated");
  // The refund's undo cannot tell either; the operator skips it, and must say why.
  await executor.nextEvent(offered(run, "refund-1", 1));
  await executor.call({ op: "compensated", run, key: "refund-1", attempt: 1, outcome: "unknown" });
  await page.waitForFunction(() => /needs human/.test(document.querySelector('#saga tr[data-key="refund-1"]')?.textContent || ""));
  await page.getByRole("button", { name: "Skip refund-1" }).click();
  await page.waitForFunction(() => /A skip needs a reason/.test(document.querySelector("#toast")?.textContent || ""));
  assert.equal((await report(run)).state, "finalizing", "nothing was skipped without a reason");
  await page.getByLabel("Reason to skip refund-1").fill("refunded by phone");
  await page.getByRole("button", { name: "Skip refund-1" }).click();
  await page.waitForFunction(() => /compensation skipped/.test(document.querySelector('#saga tr[data-key="refund-1"]')?.textContent || ""));
  assert.equal(await status(page, "charge-2"), "compensated");
  const rep = await report(run);
  assert.equal(rep.state, "cancelled");
  const skipped = rep.done.find((i) => i.key === "refund-1");
  assert.equal(skipped.note, "refunded by phone");
  assert.equal(skipped.by, "admin");
  assert.deepEqual(page.errors, [], page.errors.join("\n"));
  await context.close();
});

test("compensate one effect of a killed run from the report page", async () => {
  const run = "killed-run";
  await done(run, "refund-1", "refund", { id: "re_9" });
  await done(run, "refund-2", "refund", { id: "re_10" });
  const kill = await fetch(d.base + "/api/v1/runs/" + run + "/kill", { method: "POST", headers: { Authorization: "Bearer " + d.operatorToken } });
  assert.equal(kill.status, 200);
  const { page, context } = await loggedIn();
  await page.goto(d.base + "/#/runs/" + run);
  await page.waitForSelector("#saga");
  assert.match(await page.textContent("#saga-next"), /undoes nothing by itself/);
  await page.getByRole("button", { name: "Compensate refund-1" }).click();
  const e = await executor.nextEvent(offered(run, "refund-1", 1));
  assert.deepEqual(e.args, { refund: "re_9" });
  await executor.call({ op: "compensated", run, key: "refund-1", attempt: 1, outcome: "ok" });
  await page.waitForFunction(() => /compensated/.test(document.querySelector('#saga tr[data-key="refund-1"] .badge')?.textContent || ""));
  // Only the effect asked for; the run stays killed.
  assert.equal(await status(page, "refund-2"), "completed");
  assert.equal(executor.events.filter((x) => x.event === "compensate" && x.run === run).length, 0);
  const rep = await report(run);
  assert.equal(rep.state, "cancelled");
  assert.equal(rep.done.find((i) => i.key === "refund-1").chosen, true);
  assert.deepEqual(page.errors, [], page.errors.join("\n"));
  await context.close();
});

test("stop waiting for a call a cancelled run's agent left in flight, then say it did not happen", async () => {
  const run = "orphan-run";
  await done(run, "refund-1", "refund", { id: "re_5" });
  // Started, never reported: its agent died.
  const v = await agent.call({ op: "admit", run, key: "charge-2", tool: "charge", args: { n: 2 } });
  assert.equal(v.verdict, "admitted");
  const stop = await fetch(d.base + "/api/v1/runs/" + run + "/cancel", { method: "POST", headers: { Authorization: "Bearer " + d.operatorToken } });
  assert.equal(stop.status, 200);
  const { page, context } = await loggedIn();
  await page.goto(d.base + "/#/runs/" + run);
  await page.waitForSelector("#saga");
  assert.match(await page.textContent("#saga-next"), /charge-2 to finish \(in flight\)/);
  await page.getByRole("button", { name: "Stop waiting charge-2" }).click();
  await page.waitForFunction(() => /an operator to say whether charge-2 happened/.test(document.querySelector("#saga-next")?.textContent || ""));
  assert.equal((await report(run)).in_flight.length, 0);
  await page.getByRole("button", { name: "It did not happen charge-2" }).click();
  // Nothing to undo for it; the refund's undo is offered next.
  const e = await executor.nextEvent(offered(run, "refund-1", 1));
  assert.deepEqual(e.args, { refund: "re_5" });
  await executor.call({ op: "compensated", run, key: "refund-1", attempt: 1, outcome: "ok" });
  await page.waitForFunction(() => /cancelled/.test(document.querySelector("dl.facts")?.textContent || ""));
  const rep = await report(run);
  assert.equal(rep.failed.find((i) => i.key === "charge-2").status, "failed");
  assert.deepEqual(page.errors, [], page.errors.join("\n"));
  await context.close();
});
