// Browser tests of the estop console in headless Chromium against a real `estop serve`: an
// agent (protocol v1 over the Unix socket) asks; a person in the browser decides and stops;
// the agent sees the answer. Screenshots go to console-tests/artifacts/ (and, with
// UPDATE_SCREENSHOTS=1, to docs/).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdirSync, copyFileSync } from "node:fs";
import { join } from "node:path";
import { startDaemon, connect, launch, repo } from "../lib/estop.mjs";

const artifacts = join(repo, "console-tests", "artifacts");
mkdirSync(artifacts, { recursive: true });

let d, agent, browser, closeBrowser;

async function shot(page, name) {
  const path = join(artifacts, name);
  await page.evaluate(() => document.querySelector("#toast").replaceChildren());
  await page.screenshot({ path, fullPage: true });
  if (process.env.UPDATE_SCREENSHOTS === "1") copyFileSync(path, join(repo, "docs", name));
}

/** A logged-in page: the one-time link, then the console. */
async function loggedIn(viewport = { width: 1200, height: 900 }) {
  const context = await browser.newContext({ viewport });
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  page.errors = errors;
  // A fresh one-time link for each context (the printed one is used by the first test).
  const r = await fetch(d.base + "/api/v1/login-links", { method: "POST", headers: { Authorization: "Bearer " + d.operatorToken } });
  const { url } = await r.json();
  await page.goto(url);
  await page.waitForURL(d.base + "/");
  await page.waitForSelector("#live.on");
  return { page, context };
}

function card(page, run, key) {
  return page.locator(`article.card[data-run="${run}"][data-key="${key}"]`);
}

before(async () => {
  d = await startDaemon();
  agent = await connect(d.socket, d.agentToken);
  ({ browser, close: closeBrowser } = await launch());
});

after(async () => {
  agent?.close();
  await closeBrowser?.();
  await d?.stop();
});

test("the one-time link from DATA/console-login logs in once, with no cookie; a second use is refused", async () => {
  assert.ok(!d.consoleLine.includes("code="), "the link is not printed when stdout is no terminal: " + d.consoleLine);
  assert.match(d.loginLink, /\/login#code=[0-9a-f]{64}$/);
  const context = await browser.newContext();
  const page = await context.newPage();
  await page.goto(d.loginLink);
  await page.waitForURL(d.base + "/");
  await page.waitForSelector("#principal");
  assert.match(await page.textContent("#principal"), /admin \(operator\)/);
  assert.deepEqual(await context.cookies(), [], "no cookie: it would reach every port of the host");
  const kept = JSON.parse(await page.evaluate(() => sessionStorage.getItem("estop.session")));
  assert.match(kept.session, /^[0-9a-f]{64}$/);
  assert.match(kept.csrf, /^[0-9a-f]{64}$/);
  // The code left the address bar and the history.
  assert.ok(!page.url().includes("code="), page.url());
  const again = await (await browser.newContext()).newPage();
  await again.goto(d.loginLink);
  await again.waitForSelector("#token");
  assert.match(await again.textContent("main"), /used or has expired/);
  await context.close();
});

test("approve a held effect in the inbox: the agent's wait returns admitted", async () => {
  const held = await agent.call({ op: "admit", run: "approve-run", key: "refund-1", tool: "refund", args: { charge: "ch_42", amount: 1999 }, labels: { customer: "ana" } });
  assert.equal(held.verdict, "held");
  assert.equal(held.reason, "approval");
  const { page, context } = await loggedIn();
  const c = card(page, "approve-run", "refund-1");
  await c.waitFor();
  // The exact call, its digest, the rule, quorum progress and a countdown.
  assert.match(await c.locator("pre.args").textContent(), /"charge": "ch_42"/);
  assert.match(await c.textContent(), /[0-9a-f]{64}/);
  assert.match(await c.textContent(), /0 of 1 approval/);
  assert.match(await c.locator(".countdown").textContent(), /^\d+:\d\d$/);
  const waiting = agent.call({ op: "wait", run: "approve-run", key: "refund-1", timeout_ms: 30000 });
  await c.getByRole("textbox").fill("customer called, verified");
  await c.getByRole("button", { name: /^Approve/ }).click();
  const answer = await waiting;
  assert.equal(answer.ok, true);
  assert.equal(answer.verdict, "admitted", JSON.stringify(answer));
  await c.waitFor({ state: "detached" });
  assert.deepEqual(page.errors, [], page.errors.join("\n"));
  await context.close();
});

test("reject a held effect with a reason: the agent's wait returns refused", async () => {
  const held = await agent.call({ op: "admit", run: "reject-run", key: "refund-2", tool: "refund", args: { charge: "ch_7", amount: 5000000 } });
  assert.equal(held.verdict, "held");
  const { page, context } = await loggedIn();
  const c = card(page, "reject-run", "refund-2");
  await c.waitFor();
  const waiting = agent.call({ op: "wait", run: "reject-run", key: "refund-2", timeout_ms: 30000 });
  await c.getByRole("textbox").fill("amount is absurd");
  await c.getByRole("button", { name: /^Reject/ }).click();
  const answer = await waiting;
  assert.equal(answer.verdict, "refused", JSON.stringify(answer));
  assert.equal(answer.reason, "rejected");
  // Reject sticks: the same call under a new key is refused too.
  const again = await agent.call({ op: "admit", run: "reject-run", key: "refund-2b", tool: "refund", args: { charge: "ch_7", amount: 5000000 } });
  assert.equal(again.verdict, "refused");
  // The reason is in the run's timeline.
  await page.goto(d.base + "/#/runs/reject-run");
  await page.waitForSelector("ol.timeline li.k-decide");
  assert.match(await page.textContent("ol.timeline"), /reason=amount is absurd/);
  await context.close();
});

test("quorum progress shows who approved; the inbox updates live without a reload", async () => {
  const { page, context } = await loggedIn();
  // Held while the page is open: it appears through server-sent events.
  const held = await agent.call({ op: "admit", run: "quorum-run", key: "wire-1", tool: "wire", args: { to: "acct-9", amount: 99000, memo: "quarterly payout" } });
  assert.equal(held.verdict, "held");
  const c = card(page, "quorum-run", "wire-1");
  await c.waitFor();
  await c.getByRole("button", { name: /^Approve/ }).click();
  await c.getByText("1 of 2 approvals").waitFor();
  assert.match(await c.textContent(), /by admin/);
  // A second held effect for the screenshot: the inbox with two items, one half approved.
  await agent.call({ op: "admit", run: "support-7", key: "refund-9", tool: "refund", args: { charge: "ch_311", amount: 129.5, currency: "EUR", note: "duplicate charge" }, labels: { ticket: "T-1882" } });
  await card(page, "support-7", "refund-9").waitFor();
  await page.waitForFunction(() => document.querySelector("#inbox-count").textContent === "2");
  await shot(page, "console-inbox.png");
  await context.close();
});

test("cancel a run from the console and read its after-stop report", async () => {
  const run = "stop-run";
  // done: a refund (approved, compensable) and a payment (irreversible); in flight: an email;
  // held: another refund, voided by the cancel.
  const r0 = await agent.call({ op: "admit", run, key: "refund-0", tool: "refund", args: { charge: "ch_0", amount: 40 }, labels: { customer: "ana", ticket: "T-7" } });
  assert.equal(r0.verdict, "held");
  const decided = await fetch(d.base + "/api/v1/runs/" + run + "/effects/refund-0/approve", { method: "POST", headers: { Authorization: "Bearer " + d.operatorToken } });
  assert.equal(decided.status, 200);
  const r0a = await agent.call({ op: "wait", run, key: "refund-0", timeout_ms: 5000 });
  assert.equal(r0a.verdict, "admitted");
  assert.equal((await agent.call({ op: "complete", run, key: "refund-0", token: r0a.token, outcome: "ok", result: { refund: "re_1" } })).ok, true);
  const paid = await agent.call({ op: "admit", run, key: "pay-1", tool: "pay", args: { invoice: "inv-1" } });
  assert.equal(paid.verdict, "admitted");
  assert.equal((await agent.call({ op: "complete", run, key: "pay-1", token: paid.token, outcome: "ok" })).ok, true);
  const sent = await agent.call({ op: "admit", run, key: "email-1", tool: "send_email", args: { to: "ana@example.com" } });
  assert.equal(sent.verdict, "admitted");
  const flying = await agent.call({ op: "admit", run, key: "email-2", tool: "send_email", args: { to: "bob@example.com" } });
  assert.equal(flying.verdict, "admitted");
  assert.equal((await agent.call({ op: "complete", run, key: "email-1", token: sent.token, outcome: "ok" })).ok, true);
  const held = await agent.call({ op: "admit", run, key: "refund-3", tool: "refund", args: { charge: "ch_3", amount: 10 } });
  assert.equal(held.verdict, "held");
  const { page, context } = await loggedIn();
  await page.goto(d.base + "/#/runs");
  await page.locator(`tr[data-run="${run}"] a`).click();
  await page.waitForSelector("#report");
  await page.getByRole("button", { name: "Cancel…" }).click();
  await page.getByLabel("Cancel reason").fill("customer asked us to stop");
  const waiting = agent.call({ op: "wait", run, key: "refund-3", timeout_ms: 30000 });
  await page.getByRole("button", { name: "Confirm cancel" }).click();
  // The held effect is voided: its waiter hears it at once.
  const answer = await waiting;
  assert.equal(answer.verdict, "refused");
  assert.equal(answer.reason, "cancelled");
  // A fence: nothing new is admitted.
  const late = await agent.call({ op: "admit", run, key: "pay-2", tool: "pay", args: { invoice: "inv-2" } });
  assert.equal(late.verdict, "refused");
  assert.equal(late.reason, "cancelled");
  await page.waitForFunction(() => /Stopped \(cancelled\)/.test(document.querySelector("#report")?.textContent || ""));
  const count = async (k) => Number(await page.locator(`.summary [data-section="${k}"] b`).textContent());
  assert.equal(await count("done"), 3);
  assert.equal(await count("refused"), 1);
  assert.equal(await count("in_flight"), 1);
  assert.equal(await count("compensable"), 1);
  assert.equal(await count("irreversible"), 1);
  const report = await page.textContent("#report");
  assert.match(report, /refused: cancelled/);
  assert.match(report, /compensable → reverse_refund/);
  assert.match(await page.textContent("ol.timeline"), /reason=customer asked us to stop/);
  assert.match(await page.textContent("dl.facts"), /cancel by admin .*customer asked us to stop/);
  assert.equal(await page.getByRole("button", { name: "Cancel…" }).count(), 0, "a stop is never undone");
  await shot(page, "console-report.png");
  // The in-flight email completes after the stop: recorded, flagged late, shown live.
  assert.equal((await agent.call({ op: "complete", run, key: "email-2", token: flying.token, outcome: "ok" })).late, true);
  await page.waitForFunction(() => document.querySelector('.summary [data-section="in_flight"] b')?.textContent === "0");
  assert.equal(await count("done"), 4);
  assert.match(await page.textContent("#report"), /completed after the stop \(late\)/);
  assert.deepEqual(page.errors, [], page.errors.join("\n"));
  await context.close();
});

test("pause and resume from the run page; runs filter and search", async () => {
  const run = "pause-run";
  assert.equal((await agent.call({ op: "admit", run, key: "e1", tool: "send_email", args: { to: "x@y.z" }, labels: { team: "growth" } })).verdict, "admitted");
  const { page, context } = await loggedIn();
  await page.goto(d.base + "/#/runs/" + run);
  await page.getByRole("button", { name: "Pause" }).click();
  await page.getByRole("button", { name: "Resume" }).waitFor();
  const heldByPause = await agent.call({ op: "admit", run, key: "e2", tool: "send_email", args: { to: "q@y.z" } });
  assert.equal(heldByPause.verdict, "held");
  assert.equal(heldByPause.reason, "paused");
  const waiting = agent.call({ op: "wait", run, key: "e2", timeout_ms: 30000 });
  await page.getByRole("button", { name: "Resume" }).click();
  assert.equal((await waiting).verdict, "admitted");
  await page.goto(d.base + "/#/runs");
  await page.getByLabel("Search runs").fill("team=growth");
  await page.waitForFunction(() => document.querySelectorAll("#runs-table tbody tr").length === 1);
  assert.equal(await page.locator("#runs-table tbody tr").getAttribute("data-run"), run);
  await page.getByLabel("Search runs").fill("");
  await page.getByLabel("Filter by state").selectOption("cancelled");
  await page.waitForFunction(() => [...document.querySelectorAll("#runs-table tbody tr")].every((r) => r.dataset.run === "stop-run"));
  await context.close();
});

test("keyboard only: log in with a pasted token, move with keys, approve with Enter", async () => {
  await agent.call({ op: "admit", run: "kbd-run", key: "k1", tool: "refund", args: { amount: 1 } });
  const context = await browser.newContext();
  const page = await context.newPage();
  await page.goto(d.base + "/");
  await page.waitForSelector("#token");
  await page.keyboard.type(d.operatorToken);
  await page.keyboard.press("Enter");
  await page.waitForSelector("#live.on");
  await page.keyboard.press("r");
  await page.waitForSelector("#runs-table");
  await page.keyboard.press("i");
  await card(page, "kbd-run", "k1").waitFor();
  // j moves to the next approval; Tab reaches its reason, then Approve; Enter presses it.
  const ids = await page.$$eval("article.card", (cs) => cs.map((c) => c.dataset.run));
  for (let i = 0; i <= ids.indexOf("kbd-run"); i++) await page.keyboard.press("j");
  // Tab passes the run's link, then reaches the reason.
  for (let i = 0; i < 4; i++) {
    await page.keyboard.press("Tab");
    if (await page.evaluate(() => document.activeElement.tagName === "INPUT")) break;
  }
  assert.match(await page.evaluate(() => document.activeElement.getAttribute("aria-label")), /^Reason for deciding refund \(k1\)/);
  await page.keyboard.type("ok by keyboard");
  await page.keyboard.press("Tab");
  const focused = await page.evaluate(() => document.activeElement.getAttribute("aria-label"));
  assert.match(focused, /^Approve refund for run kbd-run/);
  await page.keyboard.press("Enter");
  await card(page, "kbd-run", "k1").waitFor({ state: "detached" });
  const v = await agent.call({ op: "wait", run: "kbd-run", key: "k1", timeout_ms: 5000 });
  assert.equal(v.verdict, "admitted");
  await context.close();
});

test("a narrow screen: no sideways scrolling, the decision buttons stay reachable", async () => {
  await agent.call({ op: "admit", run: "narrow-run", key: "n1", tool: "refund", args: { amount: 3, long_note: "x".repeat(300) } });
  const { page, context } = await loggedIn({ width: 375, height: 740 });
  await card(page, "narrow-run", "n1").waitFor();
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(overflow <= 0, `the inbox scrolls sideways by ${overflow}px`);
  await page.goto(d.base + "/#/runs/stop-run");
  await page.waitForSelector("#report");
  const overflow2 = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(overflow2 <= 0, `the report scrolls sideways by ${overflow2}px`);
  await page.goto(d.base + "/#/inbox");
  const approve = card(page, "narrow-run", "n1").getByRole("button", { name: /^Approve/ });
  await approve.scrollIntoViewIfNeeded();
  assert.ok(await approve.isVisible());
  await context.close();
});

test("state changes need the session header and the CSRF token; logging out ends the session", async () => {
  const { page, context } = await loggedIn();
  const status = await page.evaluate(async () => {
    const { session } = JSON.parse(sessionStorage.getItem("estop.session"));
    const post = (headers) => fetch("/api/v1/runs/pause-run/pause", { method: "POST", headers: { "Content-Type": "application/json", ...headers }, body: "{}" }).then((r) => r.status);
    return { none: await post({}), noCsrf: await post({ "X-Estop-Session": session }) };
  });
  assert.deepEqual(status, { none: 401, noCsrf: 403 }, "neither the page's origin nor the session alone can change state");
  const { session } = JSON.parse(await page.evaluate(() => sessionStorage.getItem("estop.session")));
  await page.getByRole("button", { name: "Log out" }).click();
  await page.waitForSelector("#token");
  assert.equal(await page.evaluate(() => sessionStorage.getItem("estop.session")), null);
  const after = await page.evaluate(async (s) => (await fetch("/api/v1/runs", { headers: { "X-Estop-Session": s } })).status, session);
  assert.equal(after, 401, "the session ended on the server too");
  await context.close();
});
