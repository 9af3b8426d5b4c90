// The console's Agents page (issue 16): a trajectory of `estop agent run`, read from the
// harness journal, with its state, budget vector and held call; its task, which the agent's
// caller wrote and which here holds a <script>, is shown as text and never runs. An operator
// interrupts and cancels a running trajectory from its page; an observer sees no action.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join, dirname } from "node:path";
import { createInterface } from "node:readline";
import { startDaemon, launch, estopBin } from "../lib/estop.mjs";

const TASK = `<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> clean up staging`;

// The scripted model: first a call of drop_table (which the policy holds for a human), then an
// answer once the call is decided.
const SCRIPT = {
  responses: [
    [
      { step: "event", chunk: { choices: [{ index: 0, delta: { tool_calls: [{ index: 0, id: "c1", type: "function", function: { name: "drop_table", arguments: "{\"table\": \"orders_staging\"}" } }] } }] } },
      { step: "event", chunk: { choices: [{ index: 0, delta: {}, finish_reason: "tool_calls" }] } },
      { step: "event", chunk: { choices: [], usage: { prompt_tokens: 120, completion_tokens: 20 } } },
      { step: "done" },
    ],
    [
      { step: "event", chunk: { choices: [{ index: 0, delta: { content: "I left <b>the table</b> alone." }, finish_reason: "stop" }] } },
      { step: "event", chunk: { choices: [], usage: { prompt_tokens: 200, completion_tokens: 8 } } },
      { step: "done" },
    ],
  ],
};

let d, scripted, agent, browser, closeBrowser;
const children = [];

/** Spawns `cmd` and resolves with the first stdout line `pred` accepts. */
function startChild(cmd, args, pred, opts = {}) {
  const child = spawn(cmd, args, { stdio: ["ignore", "pipe", "pipe"], ...opts });
  children.push(child);
  const log = [];
  createInterface({ input: child.stderr }).on("line", (l) => log.push(l));
  const out = createInterface({ input: child.stdout });
  const exited = new Promise((r) => child.once("exit", (code) => r(code)));
  const line = pred ? new Promise((res, rej) => {
    const t = setTimeout(() => rej(new Error(cmd + " not ready:\n" + log.join("\n"))), 60000);
    out.on("line", (l) => { if (pred(l)) { clearTimeout(t); res(l); } });
    child.on("exit", (code) => { clearTimeout(t); rej(new Error(`${cmd} exited ${code}:\n` + log.join("\n"))); });
  }) : null;
  return { child, line, log, exited };
}

// Starts the scripted model server on `script` (written as NAME.json in the daemon's dir):
// the child, and the head of an agent config naming it as model `scripted` with 5 turns.
async function scriptedModel(name, script) {
  writeFileSync(join(d.dir, `${name}.json`), JSON.stringify(script));
  const scriptedBin = join(dirname(estopBin()), "estop-harness-scripted");
  const model = startChild(scriptedBin, ["--script", join(d.dir, `${name}.json`), "--listen", "127.0.0.1:0"], (l) => l.startsWith("ready url="));
  const url = (await model.line).slice("ready url=".length);
  const head = `
[[model]]
name = "scripted"
base_url = "${url}"
usd_per_mtok_input = 3.0
usd_per_mtok_output = 15.0

[budget]
turns = 5
`;
  return { model, head };
}

before(async () => {
  d = await startDaemon();
  let head;
  ({ model: scripted, head } = await scriptedModel("script", SCRIPT));
  writeFileSync(join(d.dir, "agent.toml"), `${head}
[[tool]]
name = "drop_table"
command = ["sh", "-c", "cat"]

[contract]
answer_matches = "alone"
`);
  agent = startChild(estopBin(), ["agent", "run", "--data", d.dir, "--config", join(d.dir, "agent.toml"), "--model", "scripted", "--id", "traj-1", TASK], null);
  ({ browser, close: closeBrowser } = await launch());
});

after(async () => {
  await closeBrowser?.();
  for (const c of children) if (c.exitCode === null) c.kill("SIGKILL");
  await d?.stop();
});

const bearer = (token) => ({ Authorization: "Bearer " + token });

/** Polls the API (no sleep-and-hope: each try is a real read) until `pred` holds. */
async function until(path, pred, ms = 60000) {
  const end = Date.now() + ms;
  let last;
  while (Date.now() < end) {
    const r = await fetch(d.base + path, { headers: bearer(d.operatorToken) });
    last = r.status + " " + await r.text();
    if (r.ok && pred(JSON.parse(last.slice(4)))) return JSON.parse(last.slice(4));
    await new Promise((res) => setTimeout(res, 100));
  }
  throw new Error(path + ": never true; last answer " + last + "\nagent:\n" + agent.log.join("\n"));
}

async function logIn(context) {
  const page = await context.newPage();
  const r = await fetch(d.base + "/api/v1/login-links", { method: "POST", headers: bearer(d.operatorToken) });
  const { url } = await r.json();
  await page.goto(url);
  await page.waitForURL(d.base + "/");
  await page.waitForSelector("#live.on");
  return page;
}

test("the Agents page shows a held trajectory's state, budget and task as text", async () => {
  // The runner journals the record before the gate is asked: wait for the held call.
  const t = await until("/api/v1/trajectories/traj-1", (t) => t.state === "AWAITING_APPROVAL" && t.held.length === 1);
  assert.equal(t.task, TASK);
  assert.deepEqual(t.budget.dimensions[0], { dimension: "turns", spent: 1, limit: 5 });

  // An agent token does not read trajectories; an observer's would (like runs).
  const denied = await fetch(d.base + "/api/v1/trajectories", { headers: bearer(d.agentToken) });
  assert.equal(denied.status, 403);

  const context = await browser.newContext();
  const page = await logIn(context);
  await page.goto(d.base + "/#/agents");
  const row = page.locator('tr[data-trajectory="traj-1"]');
  await row.waitFor();
  assert.match(await row.innerText(), /awaiting approval/);
  assert.match(await row.innerText(), /1 \/ 5/);
  assert.match(await row.innerText(), /1 held/);

  await row.locator("a").first().click();
  await page.waitForSelector("#trajectory-task");
  assert.equal(await page.locator("#trajectory-task").innerText(), TASK, "the task is text, exactly as given");
  assert.equal(await page.locator("#trajectory-task script, #trajectory-task img").count(), 0);
  assert.match(await page.locator("#trajectory-state").innerText(), /awaiting approval/);
  assert.match(await page.locator('tr[data-dimension="turns"]').innerText(), /1 \/ 5/);
  assert.match(await page.locator("#trajectory-work").innerText(), /c1 drop_table — held for approval/);

  // Rejected: the model answers and the trajectory completes; the page shows it, and the
  // answer's markup as text.
  const rej = await fetch(d.base + "/api/v1/runs/traj-1/effects/c1/reject", { method: "POST", headers: { ...bearer(d.operatorToken), "Content-Type": "application/json" }, body: JSON.stringify({ reason: "not today" }) });
  assert.equal(rej.status, 200, await rej.text());
  assert.equal(await agent.exited, 0, agent.log.join("\n"));
  await page.reload();
  await page.waitForSelector("#trajectory-answer");
  assert.match(await page.locator("#trajectory-state").innerText(), /completed/);
  assert.equal(await page.locator("#trajectory-answer").innerText(), "I left <b>the table</b> alone.");
  assert.equal(await page.locator("#trajectory-answer b").count(), 0);
  // The task contract and the completion check that passed on the answer.
  assert.match(await page.locator("#trajectory-contract").innerText(), /"answer_matches":"alone"/);
  assert.match(await page.locator("#trajectory-check").innerText(), /^passed$/);
  assert.equal(await page.evaluate(() => window.pwned), undefined, "no agent text ran as script");
  await context.close();
});

test("an agent token's session is told it cannot read trajectories, and sees none", async () => {
  const context = await browser.newContext();
  const page = await context.newPage();
  await page.goto(d.base + "/login");
  await page.fill("#token", d.agentToken);
  await page.click("button[type=submit]");
  await page.waitForSelector("#live.on");
  await page.goto(d.base + "/#/agents");
  // Before the first read answers, the page says there are none: wait for the refusal's text.
  await page.locator("#trajectories-empty", { hasText: /need an operator or observer token/ }).waitFor();
  assert.equal(await page.locator("tr[data-trajectory]").count(), 0);
  await context.close();
});

// A model that streams and never ends a reply on its own (a `gate` no one releases): each call
// stays open until the runner cuts it.
const OPEN = {
  responses: [1, 2].map((n) => [
    { step: "event", chunk: { choices: [{ index: 0, delta: { content: "thinking " + n } }] } },
    { step: "gate" },
  ]),
};

test("an operator interrupts and cancels a running trajectory from its page; an observer sees no action", async () => {
  const { model, head } = await scriptedModel("open", OPEN);
  writeFileSync(join(d.dir, "open.toml"), head);
  const run = startChild(estopBin(), ["agent", "run", "--data", d.dir, "--config", join(d.dir, "open.toml"), "--model", "scripted", "--id", "traj-2", "count the rows"], null);
  await until("/api/v1/trajectories/traj-2", (t) => t.state === "CALLING_MODEL");

  // An observer reads the trajectory and is offered nothing to do.
  const made = await fetch(d.base + "/api/v1/tokens", { method: "POST", headers: { ...bearer(d.operatorToken), "Content-Type": "application/json" }, body: JSON.stringify({ name: "watcher", role: "observer", groups: [] }) });
  assert.equal(made.status, 200);
  const { token: observerToken } = await made.json();
  const watcher = await browser.newContext();
  const wpage = await watcher.newPage();
  await wpage.goto(d.base + "/login");
  await wpage.fill("#token", observerToken);
  await wpage.click("button[type=submit]");
  await wpage.waitForSelector("#live.on");
  await wpage.goto(d.base + "/#/agents/traj-2");
  await wpage.waitForSelector("#trajectory-readonly");
  assert.match(await wpage.locator("#trajectory-state").innerText(), /calling model/);
  assert.equal(await wpage.locator("#trajectory-actions, #trajectory-actions button").count(), 0);
  assert.equal(await wpage.locator("button", { hasText: /Interrupt|Cancel|Pause|Kill|Budget/ }).count(), 0);
  await watcher.close();

  const context = await browser.newContext();
  const page = await logIn(context);
  await page.goto(d.base + "/#/agents/traj-2");
  await page.waitForSelector("#trajectory-actions");
  assert.match(await page.locator('tr[data-dimension="turns"]').innerText(), /1 \/ 5/);
  await page.click("#trajectory-interrupt");
  await page.fill("#interrupt-message", "use the replica instead");
  await page.click("#trajectory-interrupt-go");
  await page.waitForFunction(() => /Interrupt stored/.test(document.querySelector("#toast")?.textContent || ""));
  // The open reply is cut; the runner calls the model again with the message: the page, which
  // reads again after the action, shows the second turn.
  await page.locator('tr[data-dimension="turns"]', { hasText: /2 \/ 5/ }).waitFor({ timeout: 30000 });

  await page.click("#trajectory-cancel");
  await page.fill('input[aria-label="Cancel reason"]', "enough");
  await page.click("#trajectory-cancel-go");
  await page.locator("#trajectory-state", { hasText: /canceled/ }).waitFor({ timeout: 30000 });
  assert.match(await page.locator("#trajectory-exit").innerText(), /CANCELED/);
  assert.equal(await page.locator("#trajectory-actions").count(), 0, "an ended trajectory offers nothing");
  assert.notEqual(await run.exited, 0, run.log.join("\n"));
  await context.close();
});
