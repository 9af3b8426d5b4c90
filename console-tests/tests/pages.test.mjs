// The console reads every page of a listing: with pages of a couple of items (a tiny
// --page-bytes-max), the inbox, the runs list and a run's report still show everything.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startDaemon, connect, launch } from "../lib/estop.mjs";

let d, agent, browser, closeBrowser;

before(async () => {
  d = await startDaemon({ args: ["--page-bytes-max", "600"] });
  agent = await connect(d.socket, d.agentToken);
  ({ browser, close: closeBrowser } = await launch());
});

after(async () => {
  agent?.close();
  await closeBrowser?.();
  await d?.stop();
});

test("the inbox, the runs and a report follow their cursors to the last page", async () => {
  const HELD = 7;
  for (let i = 0; i < HELD; i++) {
    const r = await agent.call({ op: "admit", run: `paged-${i}`, key: "k", tool: "refund", args: { amount: i } });
    assert.equal(r.verdict, "held");
  }
  for (let i = 0; i < 6; i++) {
    const r = await agent.call({ op: "admit", run: "many", key: `pay-${i}`, tool: "pay", args: { i } });
    assert.equal(r.verdict, "admitted");
  }
  // The API really pages here: one page does not hold the inbox.
  const auth = { headers: { Authorization: "Bearer " + d.operatorToken } };
  const first = await (await fetch(d.base + "/api/v1/pending", auth)).json();
  assert.ok(first.more && first.pending.length < HELD, JSON.stringify(first).slice(0, 200));

  const context = await browser.newContext();
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  const { url } = await (await fetch(d.base + "/api/v1/login-links", { method: "POST", ...auth })).json();
  await page.goto(url);
  await page.waitForURL(d.base + "/");
  await page.waitForFunction((n) => document.querySelectorAll("article.card").length === n, HELD);
  assert.equal(await page.textContent("#inbox-count"), String(HELD));

  await page.goto(d.base + "/#/runs");
  await page.waitForFunction((n) => document.querySelectorAll("#runs-table tr[data-run]").length === n, HELD + 1);

  await page.goto(d.base + "/#/runs/many");
  await page.waitForSelector("#report");
  const inFlight = await page.locator('#report table[data-section="in_flight"] tbody tr').count();
  assert.equal(inFlight, 6);
  assert.deepEqual(errors, [], errors.join("\n"));
  await context.close();
});
