// estop console: plain JavaScript, no build step. Every text an agent controls (run ids, keys,
// tools, arguments, labels, reasons, errors) is put on the page as text, never parsed as HTML,
// and with its control, bidi and zero-width characters shown as visible escapes (\u{202e}).
// The session is no cookie: its secret and CSRF token live in this tab's sessionStorage (which
// a page of another port or host cannot read) and go in headers of the page's own requests.
"use strict";

const S = {
  me: null,          // {principal, role, csrf, expires_at}
  pending: [],
  runs: [],
  route: { view: "inbox" },
  run: null,         // {status, report, ledger, error}
  trajectories: [],  // the harness's (estop agent run), from its journal
  trajectory: null,  // one, with its answer, or {error}
  events: null,
  refreshTimer: null,
  filter: { q: "", state: "" },
};

// ---------- showing text as it is ----------

// Characters that do not show as themselves: controls (newline and ANSI escapes among them),
// format characters (bidi overrides and isolates, zero-width spaces and joiners, soft hyphen,
// tags), line and paragraph separators, lone surrogates, and the other default-ignorables.
const HIDDEN = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{Cs}\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164\ufe00-\ufe0f\uffa0\u{e0100}-\u{e01ef}]/gu;

function escapeChar(c) {
  if (c === "\n") return "\\n";
  if (c === "\r") return "\\r";
  if (c === "\t") return "\\t";
  return "\\u{" + c.codePointAt(0).toString(16) + "}";
}

/** `s` with every hidden character as a visible escape (for attributes read aloud or shown). */
function shown(s) { return String(s).replace(HIDDEN, escapeChar); }

/** `s` as text nodes, each hidden character as a marked escape; `pre` keeps newlines. */
function textNodes(s, pre) {
  s = String(s);
  const out = [];
  let at = 0;
  for (const m of s.matchAll(HIDDEN)) {
    if (pre && m[0] === "\n") continue;
    if (m.index > at) out.push(document.createTextNode(s.slice(at, m.index)));
    const code = "U+" + m[0].codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
    const e = document.createElement("span");
    e.className = "esc";
    e.title = code;
    e.textContent = escapeChar(m[0]);
    out.push(e);
    at = m.index + m[0].length;
  }
  if (at < s.length || !out.length) out.push(document.createTextNode(s.slice(at)));
  return out;
}

// Attributes a person sees or hears; the others (data-*, href, value) keep the exact value.
const SHOWN_ATTRS = new Set(["title", "aria-label", "placeholder"]);

// ---------- small helpers ----------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.replaceChildren(...textNodes(v));
    else el.setAttribute(k, v === true ? "" : SHOWN_ATTRS.has(k) ? shown(v) : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    if (c instanceof Node) el.append(c); else el.append(...textNodes(c));
  }
  return el;
}

function $(id) { return document.getElementById(id); }

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

// This tab's session: {session, csrf}, or null.
const STORE = "estop.session";
function stored() {
  try { return JSON.parse(sessionStorage.getItem(STORE)); } catch (_) { return null; }
}
function keep(login) { sessionStorage.setItem(STORE, JSON.stringify({ session: login.session, csrf: login.csrf })); }
function forget() { sessionStorage.removeItem(STORE); }

function authHeaders(headers, method) {
  const s = stored();
  if (s && s.session) {
    headers["X-Estop-Session"] = s.session;
    if (method !== "GET") headers["X-CSRF-Token"] = s.csrf;
  }
  return headers;
}

async function api(method, path, body) {
  const headers = authHeaders({ "Accept": "application/json" }, method);
  // No cookie is ever a credential here; send none.
  const init = { method, headers, credentials: "omit", cache: "no-store" };
  if (method !== "GET") {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body || {});
  }
  const r = await fetch(path, init);
  let data = null;
  try { data = await r.json(); } catch (_) { data = null; }
  if (!r.ok) {
    const e = (data && data.error) || { code: "http_" + r.status, message: r.statusText };
    throw new ApiError(r.status, e.code, e.message);
  }
  return data;
}

const enc = encodeURIComponent;
const runPath = (run) => "/api/v1/runs/" + enc(run);

function toast(msg, isError) {
  const d = h("div", { class: isError ? "error" : "" }, msg);
  $("toast").append(d);
  setTimeout(() => d.remove(), isError ? 9000 : 4000);
}

function age(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m";
  if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
  return Math.floor(s / 86400) + "d";
}

function left(ms) {
  const s = Math.round((ms - Date.now()) / 1000);
  if (s <= 0) return "expired";
  const m = Math.floor(s / 60), sec = s % 60;
  if (m >= 60) return Math.floor(m / 60) + "h " + (m % 60) + "m";
  return m + ":" + String(sec).padStart(2, "0");
}

function clock(ms) {
  const d = new Date(ms);
  return d.toLocaleTimeString([], { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0");
}

function when(ms) { return new Date(ms).toLocaleString(); }

// Inline style attributes are refused by the CSP; CSSOM properties are not.
function bar(pct) { const s = h("span", {}); s.style.width = pct + "%"; return s; }

function badge(s) { return h("span", { class: "badge s-" + s }, s.replace(/_/g, " ")); }

const isOperator = () => S.me && S.me.role === "operator";

// ---------- routing ----------

function parseRoute() {
  const hash = location.hash.replace(/^#/, "") || "/inbox";
  const parts = hash.split("/").filter(Boolean);
  if (parts[0] === "runs" && parts.length > 1) return { view: "run", run: decodeURIComponent(parts.slice(1).join("/")) };
  if (parts[0] === "runs") return { view: "runs" };
  if (parts[0] === "agents" && parts.length > 1) return { view: "trajectory", id: decodeURIComponent(parts.slice(1).join("/")) };
  if (parts[0] === "agents") return { view: "trajectories" };
  return { view: "inbox" };
}

function runHref(run) { return "#/runs/" + enc(run); }

function trajectoryHref(id) { return "#/agents/" + enc(id); }

window.addEventListener("hashchange", () => { S.route = parseRoute(); S.run = null; S.trajectory = null; render(); refresh(true); $("main").focus(); });

// ---------- data ----------

// A listing comes in pages (at most 1000 items or 1 MiB each): follow its cursor, up to
// `maxPages`, appending each page's `lists` to the first page's.
async function allPages(path, lists, maxPages) {
  const sep = path.includes("?") ? "&" : "?";
  const first = await api("GET", path);
  let page = first;
  for (let n = 1; page.more && page.next && n < maxPages; n++) {
    page = await api("GET", path + sep + "cursor=" + enc(page.next));
    for (const k of lists) first[k] = (first[k] || []).concat(page[k] || []);
  }
  first.more = !!page.more;
  return first;
}

async function loadPending() {
  const r = await allPages("/api/v1/pending", ["pending"], 100);
  S.pending = r.pending || [];
}

async function loadRuns() {
  const r = await allPages("/api/v1/runs", ["runs"], 10);
  S.runs = (r.runs || []).sort((a, b) => b.created_at - a.created_at);
}

async function loadRun(run) {
  const out = { run };
  const [status, report] = await Promise.allSettled([
    api("GET", runPath(run)),
    allPages(runPath(run) + "/report", SECTIONS.map(([k]) => k), 100),
  ]);
  if (status.status === "rejected") { out.error = status.reason; return out; }
  out.status = status.value;
  out.report = report.status === "fulfilled" ? report.value : null;
  if (isOperator()) {
    try {
      const entries = [];
      let after = 0;
      for (let page = 0; page < 20; page++) {
        const l = await api("GET", runPath(run) + "/ledger?limit=1000&after=" + after);
        entries.push(...(l.entries || []));
        if (l.next_after === undefined || l.next_after === null) break;
        after = l.next_after;
      }
      out.ledger = entries;
    } catch (e) { out.ledgerError = e.message; }
  }
  return out;
}

// The harness's trajectories: a page of 200 (the API's bound per page), live ones first.
async function loadTrajectories() {
  try {
    const r = await api("GET", "/api/v1/trajectories?limit=200");
    S.trajectories = (r.trajectories || []).sort((a, b) => (b.live - a.live) || (b.started_at_ms - a.started_at_ms));
    S.trajectoriesMore = !!r.next;
    S.trajectoriesError = null;
  } catch (e) {
    // An agent token is refused (403), a journal over the read bound is 503: said on the page.
    if (e.status === 401) throw e;
    S.trajectories = [];
    S.trajectoriesError = e.message;
  }
}

async function loadTrajectory(id) {
  try { return await api("GET", "/api/v1/trajectories/" + enc(id)); } catch (e) { return { id, error: e }; }
}

async function refresh(all) {
  if (!S.me) return;
  try {
    const jobs = [loadPending()];
    if (S.route.view === "trajectories") jobs.push(loadTrajectories());
    if (S.route.view === "trajectory") jobs.push(loadTrajectory(S.route.id).then((t) => { S.trajectory = t; }));
    if (all || S.route.view === "runs") jobs.push(loadRuns());
    if (S.route.view === "run") jobs.push(loadRun(S.route.run).then((r) => { S.run = r; }));
    await Promise.all(jobs);
    render();
  } catch (e) {
    if (e.status === 401) return showLogin(e.message);
    toast(e.message, true);
  }
}

// Events arrive in bursts: coalesce them, and re-read a run's ledger only for its own events.
const dirty = { run: false };
function scheduleRefresh(runChanged) {
  if (runChanged) dirty.run = true;
  if (S.refreshTimer) return;
  S.refreshTimer = setTimeout(async () => {
    S.refreshTimer = null;
    const run = dirty.run;
    dirty.run = false;
    if (!S.me) return;
    try {
      const jobs = [loadPending()];
      if (S.route.view === "runs") jobs.push(loadRuns());
      if (S.route.view === "trajectories") jobs.push(loadTrajectories());
      if (S.route.view === "trajectory") jobs.push(loadTrajectory(S.route.id).then((t) => { S.trajectory = t; }));
      if (S.route.view === "run" && (run || !S.run)) jobs.push(loadRun(S.route.run).then((r) => { S.run = r; }));
      await Promise.all(jobs);
      render();
    } catch (e) {
      if (e.status === 401) showLogin(e.message); else toast(e.message, true);
    }
  }, 250);
}

function live(state, text) {
  const el = $("live");
  el.className = "live " + state;
  el.textContent = text;
}

// The feed of changes: server-sent events read with fetch (EventSource cannot send the session
// header). Reconnects with a growing pause; a 401 means the session ended.
function connectEvents() {
  if (S.events) S.events.abort();
  const ctl = new AbortController();
  S.events = ctl;
  follow(ctl);
}

async function follow(ctl) {
  let pause = 1000;
  while (!ctl.signal.aborted) {
    try {
      const headers = authHeaders({ "Accept": "text/event-stream" }, "GET");
      const r = await fetch("/api/v1/events", { headers, credentials: "omit", cache: "no-store", signal: ctl.signal });
      if (r.status === 401) { showLogin("Your session ended: log in again."); return; }
      if (r.ok && r.body) { pause = 1000; await readEvents(r.body, ctl); }
    } catch (_) { /* the connection dropped: reconnect below */ }
    if (ctl.signal.aborted) return;
    live("off", "reconnecting…");
    await new Promise((res) => setTimeout(res, pause));
    pause = Math.min(pause * 2, 15000);
  }
}

// Most bytes of one event: the page stops reading a stream that sends more without an end.
const EVENT_BYTES_MAX = 1 << 20;

async function readEvents(body, ctl) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  ctl.signal.addEventListener("abort", () => reader.cancel().catch(() => {}));
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let type = "message";
      const data = [];
      for (const line of block.split("\n")) {
        const m = /^([^:]*)(?::\s?(.*))?$/.exec(line);
        if (!m || m[1] === "") continue;
        if (m[1] === "event") type = m[2] || "";
        else if (m[1] === "data") data.push(m[2] || "");
      }
      onEvent(type, data.join("\n"));
    }
    if (buf.length > EVENT_BYTES_MAX) { reader.cancel().catch(() => {}); return; }
  }
}

function onEvent(type, data) {
  if (type === "ready") { live("on", "live"); refresh(true); return; }
  let e = null;
  try { e = JSON.parse(data); } catch (_) { return; }
  scheduleRefresh(S.route.view === "run" && e.run === S.route.run);
}

// ---------- actions ----------

async function act(button, method, path, body, done) {
  button.disabled = true;
  try {
    const r = await api(method, path, body);
    if (done) toast(done(r));
    await refresh(true);
  } catch (e) {
    if (e.status === 401) return showLogin(e.message);
    toast(e.message, true);
  } finally {
    button.disabled = false;
  }
}

function decide(p, decision, reason, button) {
  const path = runPath(p.run) + "/effects/" + enc(p.key) + "/decide";
  const body = { decision };
  if (reason) body.reason = reason;
  return act(button, "POST", path, body, (r) => {
    if (r.status === "held") return `Approved by you: ${r.approvals.length} of ${r.quorum} approvals for ${p.tool} (${p.key}).`;
    return `${p.tool} (${p.key}) is ${r.status}.`;
  });
}

// ---------- views ----------

// What an egress effect's recorded arguments say it reached: "METHOD URL" for an HTTP request,
// "model M at HOST" for a model call; "" for other arguments.
function requestText(a) {
  if (!a || typeof a !== "object") return "";
  if (typeof a.method === "string" && typeof a.url === "string") return a.method + " " + a.url;
  if (typeof a.host === "string" && a.model !== undefined) return "model " + String(a.model) + " at " + a.host;
  return "";
}

// A report item's request, its answer (status, bytes) and its error, for the Tool cell.
function requestOf(it) {
  let s = requestText(it.args);
  if (it.http_status !== undefined) s += " \u2192 " + it.http_status;
  if (it.bytes !== undefined) s += " (" + it.bytes + " bytes)";
  if (it.error) s += (s ? " \u2014 " : "") + it.error;
  return s;
}

function pendingCard(p, index) {
  const reasonId = "reason-" + index;
  const reason = h("input", { id: reasonId, class: "grow", type: "text", maxlength: "1024", placeholder: "Reason (optional, recorded in the ledger)", "aria-label": `Reason for deciding ${p.tool} (${p.key})` });
  const approvals = p.approvals || [];
  const pct = Math.min(100, Math.round((approvals.length / Math.max(1, p.quorum)) * 100));
  const argsText = p.args === undefined ? null : textNodes(JSON.stringify(p.args, null, 2), true);
  const countdown = h("span", { class: "countdown", "data-expires": String(p.expires_at), title: "expires " + when(p.expires_at) }, left(p.expires_at));
  const undo = p.compensates !== undefined;
  const label = undo ? `${p.tool}, the undo of ${p.compensates} for run ${p.run}, key ${p.key}` : `${p.tool} for run ${p.run}, key ${p.key}`;
  const approve = h("button", { type: "button", class: "approve", "aria-label": "Approve " + label }, "Approve");
  const reject = h("button", { type: "button", class: "reject", "aria-label": "Reject " + label, title: undo ? "Rejected, the undo is not sent: the effect waits for an operator (retry asks for a new approval, or skip it)" : "A reject is final: the same call is refused in this run from now on" }, "Reject");
  approve.addEventListener("click", () => decide(p, "approve", reason.value.trim(), approve));
  reject.addEventListener("click", () => decide(p, "reject", reason.value.trim(), reject));
  const fk = (what) => what + "\u0000" + p.run + "\u0000" + p.key;
  reason.dataset.focus = fk("reason");
  approve.dataset.focus = fk("approve");
  reject.dataset.focus = fk("reject");
  return h("article", { class: "card", "data-undo": undo ? "true" : "false", "data-run": p.run, "data-key": p.key, "data-focus": fk("card"), "aria-label": "Approval: " + label, tabindex: "-1" },
    h("header", {},
      h("div", {}, h("span", { class: "tool" }, p.tool), " ",
        undo ? h("span", { class: "badge undo" }, "undo of " + p.compensates) : null, undo ? " " : null,
        h("span", { class: "muted" }, "run "), h("a", { href: runHref(p.run) }, p.run),
        h("span", { class: "muted" }, " · key "), h("span", { class: "mono" }, p.key)),
      h("div", {}, "Expires in ", countdown)),
    h("dl", { class: "facts" },
      requestText(p.args) ? [h("dt", {}, "Request"), h("dd", { class: "mono request" }, requestText(p.args))] : null,
      h("dt", {}, "Call"),
      h("dd", {}, argsText === null ? h("span", { class: "muted" }, "digest only: the agent did not send the arguments") : h("pre", { class: "args" }, argsText)),
      h("dt", {}, "Digest"), h("dd", { class: "mono", title: "SHA-256 of the canonical {tool, args}: the approval binds to exactly this call" }, p.digest),
      h("dt", {}, "Rule"), h("dd", { class: "mono" }, p.rule || "-"),
      h("dt", {}, "Quorum"),
      h("dd", {}, h("div", { class: "quorum" },
        h("div", { class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": String(p.quorum), "aria-valuenow": String(approvals.length), "aria-label": "approvals" }, bar(pct)),
        h("span", { class: "quorum-text" }, `${approvals.length} of ${p.quorum} approval${p.quorum === 1 ? "" : "s"}`),
        approvals.length ? h("span", { class: "muted" }, "by " + approvals.join(", ")) : null,
        (p.groups || []).length ? h("span", { class: "muted" }, "from groups " + p.groups.join(", ")) : null)),
      h("dt", {}, "Held since"), h("dd", {}, when(p.created_at), h("span", { class: "muted" }, " (" + age(p.created_at) + " ago)"))),
    isOperator()
      ? h("div", { class: "decide" }, h("div", { class: "row" }, reason, approve, reject))
      : h("p", { class: "muted" }, "Only an operator can decide."));
}

function viewInbox() {
  const main = $("main");
  main.replaceChildren(h("h1", {}, "Approvals inbox"));
  if (!S.pending.length) {
    main.append(h("div", { class: "empty" }, "Nothing awaits a decision. Held effects appear here the moment an agent asks."));
    return;
  }
  main.append(h("p", { class: "muted" }, `${S.pending.length} effect${S.pending.length === 1 ? "" : "s"} held for a decision, soonest to expire first. Approving binds to the digest shown: a different call needs its own approval.`));
  main.append(h("div", { class: "cards", id: "cards" }, S.pending.map(pendingCard)));
}

function limitsUsed(r) {
  const e = r.effects || {};
  const used = (e.admitted || 0) + (e.started || 0) + (e.completed || 0) + (e.failed || 0) + (e.unknown || 0);
  const parts = [];
  parts.push(r.max_effects ? `${used}/${r.max_effects} effects` : `${used} effects`);
  if (r.deadline_at) parts.push(r.stopped_at ? "deadline " + when(r.deadline_at) : "deadline in " + left(r.deadline_at));
  return parts.join(" · ");
}

function labels(r) {
  return Object.entries(r.labels || {}).map(([k, v]) => h("span", { class: "chip" }, k + "=" + v));
}

function matches(r, q) {
  if (!q) return true;
  q = q.toLowerCase();
  const hay = [r.run, r.owner, r.parent || "", r.cause || "", r.state, ...Object.entries(r.labels || {}).map(([k, v]) => k + "=" + v)].join(" ").toLowerCase();
  return q.split(/\s+/).every((t) => hay.includes(t));
}

function viewRuns() {
  const main = $("main");
  const states = ["", "active", "paused", "finalizing", "completed", "failed", "cancelled"];
  const search = h("input", { "data-focus": "search", id: "search", type: "search", class: "grow", placeholder: "Search run, owner, label (k=v), cause", value: S.filter.q, "aria-label": "Search runs" });
  const select = h("select", { "data-focus": "state", id: "state", "aria-label": "Filter by state" }, states.map((s) => h("option", { value: s, selected: S.filter.state === s }, s || "all states")));
  search.addEventListener("input", () => { S.filter.q = search.value; drawTable(); });
  select.addEventListener("change", () => { S.filter.state = select.value; drawTable(); });
  const holder = h("div", { id: "runs-table" });
  main.replaceChildren(h("h1", {}, "Runs"), h("div", { class: "row panel" }, search, select), holder);
  drawTable();
}

function drawTable() {
  const holder = $("runs-table");
  if (!holder) return;
  const rows = S.runs.filter((r) => (!S.filter.state || r.state === S.filter.state) && matches(r, S.filter.q));
  if (!rows.length) {
    holder.replaceChildren(h("div", { class: "empty" }, S.runs.length ? "No run matches." : "No runs yet. A run appears with its first admit."));
    return;
  }
  const cols = ["Run", "State", "Owner", "Labels", "Age", "Done / in flight / held / refused", "Limits used", "Cause"];
  holder.replaceChildren(h("table", { class: "stack" },
    h("thead", {}, h("tr", {}, cols.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((r) => {
      const e = r.effects || {};
      return h("tr", { "data-run": r.run },
        h("td", { "data-label": cols[0] }, h("a", { href: runHref(r.run), class: "mono" }, r.run), r.parent ? h("div", { class: "muted" }, "child of " + r.parent) : null),
        h("td", { "data-label": cols[1] }, badge(r.state)),
        h("td", { "data-label": cols[2] }, r.owner),
        h("td", { "data-label": cols[3] }, labels(r)),
        h("td", { "data-label": cols[4], class: "num", title: when(r.created_at) }, age(r.created_at)),
        h("td", { "data-label": cols[5], class: "num" }, `${e.completed || 0} / ${e.started || 0} / ${e.held || 0} / ${e.refused || 0}`),
        h("td", { "data-label": cols[6] }, limitsUsed(r)),
        h("td", { "data-label": cols[7] }, r.cause || "-"));
    }))));
}

const TERMINAL = ["completed", "failed", "cancelled"];

function runActions(st) {
  if (!isOperator()) return h("p", { class: "muted" }, "Read-only: you are logged in with an agent token.");
  const box = h("div", {});
  const bar = h("div", { class: "actions", role: "group", "aria-label": "Run actions" });
  const stopped = TERMINAL.includes(st.state) || st.state === "finalizing";
  const path = runPath(st.run);
  const simple = (label, action, cls, msg) => {
    const b = h("button", { type: "button", class: cls || "" }, label);
    b.addEventListener("click", () => act(b, "POST", path + "/" + action, {}, () => msg));
    return b;
  };
  const confirmStop = (action, label, text) => {
    const b = h("button", { type: "button", class: "danger" }, label + "…");
    b.addEventListener("click", () => {
      const reason = h("input", { id: "stop-reason", type: "text", class: "grow", maxlength: "1024", placeholder: "Reason (recorded in the ledger)", "aria-label": label + " reason" });
      const go = h("button", { type: "button", class: "danger" }, "Confirm " + label.toLowerCase());
      const no = h("button", { type: "button" }, "Keep running");
      go.addEventListener("click", () => act(go, "POST", path + "/" + action, reason.value.trim() ? { reason: reason.value.trim() } : {},
        (r) => `${label}: ${(r.runs || [st.run]).join(", ")} fenced; state ${r.state}.`));
      no.addEventListener("click", () => { box.querySelector(".confirm")?.remove(); b.focus(); });
      box.querySelector(".confirm")?.remove();
      box.append(h("div", { class: "confirm", role: "group", "aria-label": "Confirm " + label }, h("span", {}, text), reason, go, no));
      reason.focus();
    });
    return b;
  };
  if (!stopped) {
    if (st.state === "paused") bar.append(simple("Resume", "resume", "", "Resumed: held admissions may proceed."));
    else bar.append(simple("Pause", "pause", "", "Paused: new admissions and starts are held."));
    bar.append(confirmStop("cancel", "Cancel", "Fence this run and its sub-runs: nothing new is admitted or started."));
    bar.append(confirmStop("kill", "Kill", "Cancel without compensation, and stop the run's processes where estop launched them."));
    bar.append(simple("Close as completed", "close", "", "Closed."));
  } else {
    bar.append(h("span", { class: "muted" }, "This run is stopped: a stop is never undone."));
  }
  box.prepend(bar);
  return box;
}

const SECTIONS = [
  ["done", "Done", "good"],
  ["refused", "Refused", "bad"],
  ["in_flight", "In flight", "warn"],
  ["unknown", "Unknown outcome", "bad"],
  ["failed", "Failed", "bad"],
  ["held", "Held / not started", "warn"],
  ["compensable", "Compensable", ""],
  ["irreversible", "Irreversible", "bad"],
  ["undeclared", "Undeclared reversibility", "warn"],
];

const COMPENSATION = { compensating: "running", compensated: "succeeded", compensation_failed: "failed", needs_human: "needs a human" };

function reportView(rep) {
  if (!rep) return h("p", { class: "muted" }, "No report.");
  const wrap = h("section", { id: "report", "aria-labelledby": "report-h" }, h("h2", { id: "report-h" }, "After-stop report"));
  wrap.append(h("p", { class: "muted" }, rep.cause ? `Stopped (${rep.cause}): what was done, refused, still in flight or unknown, and what can be undone.` : `The run is ${rep.state}; the report shows what happened so far.`));
  wrap.append(h("div", { class: "summary" }, SECTIONS.map(([k, label, tone]) =>
    h("div", { class: tone, "data-section": k }, h("b", {}, String((rep[k] || []).length)), label))));
  for (const [k, label] of SECTIONS) {
    const items = rep[k] || [];
    if (!items.length) continue;
    const comp = k === "compensable";
    wrap.append(h("h3", {}, label + " (" + items.length + ")"));
    wrap.append(h("table", { class: "stack", "data-section": k },
      h("thead", {}, h("tr", {}, ["Key", "Tool", "Status", "Reversibility", comp ? "Compensation" : "Why / note"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, items.map((it) => h("tr", {},
        h("td", { "data-label": "Key", class: "mono" }, it.key),
        h("td", { "data-label": "Tool", class: "mono" }, it.tool, requestOf(it) ? h("div", { class: "request" }, requestOf(it)) : null),
        h("td", { "data-label": "Status" }, badge(it.status)),
        h("td", { "data-label": "Reversibility" }, it.reversibility + (it.compensate ? " → " + it.compensate : "")),
        h("td", { "data-label": comp ? "Compensation" : "Why / note" },
          comp ? (COMPENSATION[it.status] || "not run") : [it.reason ? "refused: " + it.reason : "", it.late ? " completed after the stop (late)" : ""].join("").trim() || "-"))))));
  }
  return wrap;
}

// ---------- the reverse saga: what is undone, and the operator's word on it ----------

const WAITS = {
  outcome: (k) => `${k} to finish (in flight)`,
  lookup: (k) => `an executor to look up ${k}'s unknown outcome`,
  looking_up: (k) => `the lookup of ${k}'s unknown outcome to be reported`,
  settle: (k) => `an operator to say whether ${k} happened`,
  executor: (k) => `an executor to run ${k}'s undo`,
  running: (k) => `${k}'s undo to be reported`,
  human: (k) => `an operator: retry or skip ${k}'s undo`,
  approval: (k, n) => `approvers to decide ${k}'s undo (approval ${n.approval}, in the inbox: a retry does not stand in for the quorum)`,
};

// Every effect the saga may touch once: a compensable or unknown one (the report lists an effect
// in several sections).
function undoItems(rep) {
  const seen = new Map();
  for (const [k] of SECTIONS) for (const it of rep[k] || []) {
    if ((it.compensate || it.status === "unknown" || (it.status === "started" && rep.cause)) && !seen.has(it.key)) seen.set(it.key, it);
  }
  return [...seen.values()];
}

// The operator's buttons for one effect: what its status and the run's stop allow (the gate
// checks again and says why when it refuses).
function undoActions(st, rep, it) {
  const path = runPath(st.run) + "/effects/" + enc(it.key) + "/";
  const label = (verb) => `${verb} ${shown(it.key)}`;
  const say = (r) => `${it.key}: ${r.status}` + (r.attempt ? ` (attempt ${r.attempt})` : "");
  const button = (text, action, body, cls) => {
    const b = h("button", { type: "button", class: cls || "", "data-focus": action + ":" + it.key, "aria-label": label(text) }, text);
    b.addEventListener("click", () => {
      const sent = typeof body === "function" ? body() : body;
      if (sent) act(b, "POST", path + action, sent, say);
    });
    return b;
  };
  const out = [];
  const stopped = TERMINAL.includes(st.state) || st.state === "finalizing";
  if (!stopped) return out;
  if (it.status === "started") {
    // Its agent died or will never report: the operator says what happened, or stops waiting.
    out.push(button("It happened", "settle", { outcome: "ok" }, "approve"), button("It did not happen", "settle", { outcome: "error" }),
      button("Stop waiting", "settle", { outcome: "unknown" }));
  }
  if (it.status === "unknown") {
    const result = h("input", { type: "text", class: "grow", placeholder: "Result as JSON (optional)", "aria-label": label("Result of") });
    out.push(button("It happened", "settle", () => {
      const body = { outcome: "ok" };
      if (result.value.trim()) {
        try { body.result = JSON.parse(result.value); } catch (e) { toast("The result is not JSON: " + e.message, true); return null; }
      }
      return body;
    }, "approve"), result, button("It did not happen", "settle", { outcome: "error" }));
    if (it.lookup && it.lookups) out.push(button("Look up again", "retry", {}));
  }
  const voting = rep.saga_next && rep.saga_next.waits === "approval" && rep.saga_next.key === it.key;
  if (!voting && (it.status === "compensation_failed" || it.status === "needs_human")) out.push(button("Retry", "retry", {}, "approve"));
  const skippable = ["compensation_failed", "needs_human"].includes(it.status) || (it.status === "completed" && rep.cause === "cancelled");
  if (it.compensate && skippable) {
    const reason = h("input", { type: "text", class: "grow", maxlength: "1024", placeholder: "Why skip (recorded)", "aria-label": label("Reason to skip") });
    const b = h("button", { type: "button", class: "danger", "aria-label": label("Skip") }, "Skip");
    b.addEventListener("click", () => {
      if (!reason.value.trim()) { toast("A skip needs a reason.", true); reason.focus(); return; }
      act(b, "POST", path + "skip", { reason: reason.value.trim() }, say);
    });
    out.push(reason, b);
  }
  if (it.compensate && it.status === "completed" && rep.cause && rep.cause !== "cancelled" && !it.chosen) {
    out.push(button("Compensate", "compensate", {}, "approve"));
  }
  return out;
}

function sagaView(st, rep) {
  if (!rep) return null;
  const items = undoItems(rep);
  if (!items.length) return null;
  const sec = h("section", { id: "saga", "aria-labelledby": "saga-h" }, h("h2", { id: "saga-h" }, "Undo (reverse saga)"));
  const next = rep.saga_next;
  sec.append(h("p", { id: "saga-next", class: next ? "" : "muted" }, next ? "The saga waits for " + (WAITS[next.waits] || ((k) => next.waits + " on " + k))(next.key, next) + "." :
    rep.cause === "cancelled" || items.some((i) => i.chosen) ? "Nothing is waiting." : "A kill, a close or a limit undoes nothing by itself: compensate an effect here to undo it."));
  const cols = ["Key", "Tool", "Status", "Undo", "Attempts", "Note", isOperator() ? "Operator" : null].filter(Boolean);
  sec.append(h("table", { class: "stack" },
    h("thead", {}, h("tr", {}, cols.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, items.map((it) => h("tr", { "data-key": it.key },
      h("td", { "data-label": "Key", class: "mono" }, it.key),
      h("td", { "data-label": "Tool", class: "mono" }, it.tool),
      h("td", { "data-label": "Status" }, badge(it.status)),
      h("td", { "data-label": "Undo", class: "mono" }, (it.compensate || "-") + (it.lookup ? " (lookup " + it.lookup + ")" : "")),
      h("td", { "data-label": "Attempts", class: "num" }, it.attempts_max ? `${it.attempts}/${it.attempts_max}` : "-"),
      h("td", { "data-label": "Note" }, [it.note || "", it.by ? " by " + it.by : ""].join("").trim() || "-"),
      isOperator() ? h("td", { "data-label": "Operator" }, h("div", { class: "row" }, undoActions(st, rep, it))) : null)))));
  return sec;
}

function timelineView(run) {
  const sec = h("section", { "aria-labelledby": "tl-h" }, h("h2", { id: "tl-h" }, "Timeline (from the ledger)"));
  if (!isOperator()) { sec.append(h("p", { class: "muted" }, "The ledger is for operators.")); return sec; }
  if (run.ledgerError) { sec.append(h("p", { class: "muted" }, run.ledgerError)); return sec; }
  const entries = run.ledger || [];
  if (!entries.length) { sec.append(h("p", { class: "muted" }, "No records yet.")); return sec; }
  const skip = new Set(["seq", "at", "kind", "run", "key", "principal"]);
  sec.append(h("ol", { class: "timeline" }, entries.map((e) => {
    const extra = Object.entries(e).filter(([k]) => !skip.has(k)).map(([k, v]) => h("span", { class: "chip" }, k + "=" + (typeof v === "string" ? v : JSON.stringify(v))));
    return h("li", { class: "k-" + e.kind },
      h("time", { datetime: new Date(e.at).toISOString(), title: when(e.at) }, clock(e.at)),
      h("strong", {}, e.kind), e.key ? h("span", { class: "mono" }, " " + e.key) : null,
      h("span", { class: "muted" }, " by " + e.principal + " · #" + e.seq), " ", extra);
  })));
  return sec;
}

// The ledger record of the run's stop, if the timeline holds it: who stopped it and why.
function stopEntry(run) {
  return (run.ledger || []).filter((e) => ["cancel", "kill", "close"].includes(e.kind)).pop();
}

function stopText(e) {
  return `${e.kind} by ${e.principal} at ${when(e.at)}` + (e.reason ? ` — “${e.reason}”` : "");
}

function viewRun() {
  const main = $("main");
  const run = S.run;
  if (!run) { main.replaceChildren(h("h1", {}, S.route.run), h("p", { class: "muted" }, "Loading…")); return; }
  if (run.error) {
    main.replaceChildren(h("h1", { class: "mono" }, run.run), h("div", { class: "empty" }, run.error.message));
    return;
  }
  const st = run.status;
  const facts = h("dl", { class: "facts" },
    h("dt", {}, "State"), h("dd", {}, badge(st.state), st.cause && st.cause !== st.state ? " (" + st.cause + ")" : ""),
    stopEntry(run) ? [h("dt", {}, "Stop"), h("dd", {}, stopText(stopEntry(run)))] : null,
    h("dt", {}, "Owner"), h("dd", {}, st.owner),
    st.parent ? [h("dt", {}, "Parent"), h("dd", {}, h("a", { href: runHref(st.parent), class: "mono" }, st.parent))] : null,
    h("dt", {}, "Labels"), h("dd", {}, labels(st).length ? labels(st) : "-"),
    h("dt", {}, "Created"), h("dd", {}, when(st.created_at), h("span", { class: "muted" }, " (" + age(st.created_at) + " ago)")),
    st.stopped_at ? [h("dt", {}, "Stopped"), h("dd", {}, when(st.stopped_at))] : null,
    h("dt", {}, "Limits used"), h("dd", {}, limitsUsed(st)),
    h("dt", {}, "Epoch"), h("dd", {}, String(st.epoch)));
  const mine = S.pending.filter((p) => p.run === st.run);
  main.replaceChildren(...[
    h("p", {}, h("a", { href: "#/runs" }, "← Runs")),
    h("h1", {}, "Run ", h("span", { class: "mono" }, st.run)),
    h("div", { class: "panel" }, facts, runActions(st)),
    mine.length ? [h("h2", {}, "Awaiting approval"), h("div", { class: "cards" }, mine.map(pendingCard))] : null,
    reportView(run.report),
    sagaView(st, run.report),
    timelineView(run)].flat().filter(Boolean));
}

// ---------- trajectories (the harness's agents) ----------

// "3/5" or "3" (no ceiling); wall clock and dollars in their units.
function spent(d) {
  const f = d.dimension === "usd_micros" ? (n) => "$" + (n / 1e6).toFixed(4)
    : d.dimension === "wall_clock_ms" ? (n) => (n / 1000).toFixed(1) + " s" : String;
  return d.limit === null || d.limit === undefined ? f(d.spent) : f(d.spent) + " / " + f(d.limit);
}

const DIMENSION = { turns: "Turns", tokens: "Tokens", wall_clock_ms: "Wall clock", usd_micros: "Dollars" };

function budgetView(b) {
  return h("table", { class: "budget" },
    h("thead", {}, h("tr", {}, ["Dimension", "Spent / limit", "Used"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, b.dimensions.map((d) => {
      const pct = d.limit ? Math.min(100, Math.round(100 * d.spent / d.limit)) : null;
      return h("tr", { "data-dimension": d.dimension },
        h("td", {}, DIMENSION[d.dimension] || d.dimension),
        h("td", { class: "num" }, spent(d)),
        h("td", {}, pct === null ? "-" : h("div", { class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(pct), "aria-label": (DIMENSION[d.dimension] || d.dimension) + " used" }, bar(pct))));
    })));
}

function stageText(b) {
  return b.stage + (b.binding ? ` (${b.binding} ${(b.permille / 10).toFixed(1)}%)` : "");
}

function exitText(e) { return e ? e.exit + (e.reason ? ": " + e.reason : "") : "-"; }
// The completion check's last result: passed, or each failed check with why, and the notice
// turns it gave.
function checkText(c) {
  if (!c) return "-";
  const what = c.passed ? "passed" : "failed: " + c.failed.map((f) => f.check + " (" + f.why + ")").join("; ");
  return what + (c.notices ? ` · ${c.notices} notice turn${c.notices === 1 ? "" : "s"}` : "");
}

function controlText(c) {
  if (c.control === "interrupt") return "interrupt: " + c.message;
  if (c.control === "cancel" || c.control === "kill") return c.control + ": " + c.reason;
  if (c.control === "budget") return "budget: " + JSON.stringify(c.limits);
  return c.control;
}

const trajectoryPath = (id) => "/api/v1/trajectories/" + enc(id);

// What an operator may do to a live trajectory: the gate's verbs on its run (pause, resume,
// cancel, kill) and the runner's (an interrupt with a new user message, a budget change). The
// runner applies each at its next turn boundary: the page reads the journal again just after.
function trajectoryActions(t) {
  if (!isOperator()) return h("p", { class: "muted", id: "trajectory-readonly" }, "Read-only: acting on a trajectory needs an operator.");
  if (!t.live) return h("p", { class: "muted" }, "This trajectory has ended: nothing to act on.");
  const box = h("div", { id: "trajectory-actions" });
  const bar = h("div", { class: "actions", role: "group", "aria-label": "Trajectory actions" });
  const path = trajectoryPath(t.id);
  // The runner applies a request at its next boundary, and journals it then: read again a
  // few times after the action (each read is one bounded GET).
  const send = (b, action, body, msg) => act(b, "POST", path + "/" + action, body, (r) => {
    for (const ms of [500, 1500, 4000]) setTimeout(() => scheduleRefresh(false), ms);
    return msg(r);
  });
  const simple = (label, action, msg) => {
    const b = h("button", { type: "button", id: "trajectory-" + action }, label);
    b.addEventListener("click", () => send(b, action, {}, () => msg));
    return b;
  };
  // A form under the bar: one at a time.
  const form = (label, fields, build, cls) => {
    const b = h("button", { type: "button", class: cls || "", id: "trajectory-" + label.toLowerCase() }, label + "…");
    b.addEventListener("click", () => {
      const go = h("button", { type: "button", class: cls || "", id: "trajectory-" + label.toLowerCase() + "-go" }, "Send " + label.toLowerCase());
      const no = h("button", { type: "button" }, "Never mind");
      go.addEventListener("click", () => {
        const [action, body, msg] = build();
        if (body) send(go, action, body, msg);
      });
      no.addEventListener("click", () => { box.querySelector(".confirm")?.remove(); b.focus(); });
      box.querySelector(".confirm")?.remove();
      box.append(h("div", { class: "confirm", role: "group", "aria-label": label }, ...fields, go, no));
      fields[0].focus();
    });
    return b;
  };
  const reason = (label) => h("input", { type: "text", class: "grow", maxlength: "1024", placeholder: "Reason (recorded in the ledger)", "aria-label": label + " reason" });
  const stop = (label, action) => {
    const r = reason(label);
    return form(label, [r], () => [action, r.value.trim() ? { reason: r.value.trim() } : {}, (x) => `${label}: ${(x.runs || [t.id]).join(", ")} fenced; the trajectory ends at its next boundary.`], "danger");
  };
  if (t.state === "PAUSED") bar.append(simple("Resume", "resume", "Resumed."));
  else bar.append(simple("Pause", "pause", "Paused: the trajectory stops at its next boundary."));
  const message = h("textarea", { id: "interrupt-message", class: "grow", rows: "2", maxlength: "60000", placeholder: "A new user message, applied at the next turn boundary", "aria-label": "Interrupt message" });
  bar.append(form("Interrupt", [message], () => {
    const m = message.value.trim();
    if (!m) { toast("An interrupt needs a message.", true); return ["", null]; }
    return ["interrupt", { message: m }, (r) => `Interrupt stored; the trajectory is ${r.state}.`];
  }));
  const num = (label) => h("input", { type: "number", min: "0", step: "any", class: "num", placeholder: label, "aria-label": label });
  const turns = num("Turns"), tokens = num("Tokens"), usd = num("Dollars");
  bar.append(form("Budget", [turns, tokens, usd], () => {
    const body = {};
    if (turns.value !== "") body.turns = Math.round(Number(turns.value));
    if (tokens.value !== "") body.tokens = Math.round(Number(tokens.value));
    if (usd.value !== "") body.usd_micros = Math.round(Number(usd.value) * 1e6);
    if (!Object.keys(body).length) { toast("Give at least one ceiling.", true); return ["", null]; }
    return ["budget", body, (r) => `Budget change stored; the trajectory is ${r.state}.`];
  }));
  bar.append(stop("Cancel", "cancel"));
  bar.append(stop("Kill", "kill"));
  box.prepend(bar);
  return box;
}

function childrenView(t) {
  const kids = t.children || [];
  if (!kids.length) return null;
  const more = (t.children_count || 0) - kids.length;
  return [h("h2", {}, "Sub-agents"),
    h("ul", { id: "trajectory-children" }, kids.map((c) => h("li", {},
      h("a", { href: trajectoryHref(c.id), class: "mono" }, c.id), " ", badge(c.state.toLowerCase()),
      ` turns ${c.turns}${c.limits.turns_max != null ? "/" + c.limits.turns_max : ""} · tokens ${c.tokens} · $${(c.usd_micros / 1e6).toFixed(4)}`,
      c.exit ? " · " + exitText(c.exit) : ""))),
    more > 0 ? h("p", { class: "muted" }, `and ${more} more`) : null];
}

function viewTrajectories() {
  const main = $("main");
  const rows = S.trajectories;
  const cols = ["Trajectory", "State", "Task", "Turns", "Budget stage", "Pending", "Exit"];
  const body = rows.length ? h("table", { class: "stack", id: "trajectories" },
    h("thead", {}, h("tr", {}, cols.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((t) => h("tr", { "data-trajectory": t.id },
      h("td", { "data-label": cols[0] }, h("a", { href: trajectoryHref(t.id), class: "mono" }, t.id),
        t.parent ? h("div", { class: "muted" }, "child of ", h("a", { href: runHref(t.parent), class: "mono" }, t.parent)) : null),
      h("td", { "data-label": cols[1] }, badge(t.state.toLowerCase())),
      h("td", { "data-label": cols[2], class: "task" }, t.task),
      h("td", { "data-label": cols[3], class: "num" }, spent(t.budget.dimensions[0])),
      h("td", { "data-label": cols[4] }, stageText(t.budget)),
      h("td", { "data-label": cols[5], class: "num" }, `${t.pending.length} in flight · ${t.held.length} held · ${t.control.length} control`),
      h("td", { "data-label": cols[6] }, exitText(t.exit))))))
    : h("div", { class: "empty", id: "trajectories-empty" }, S.trajectoriesError || "No trajectories. `estop agent run` keeps them in DATA/harness/journal, where the console reads them.");
  main.replaceChildren(h("h1", {}, "Agents"),
    h("p", { class: "muted" }, "Trajectories of estop's own agent loop, read from the harness journal; live ones first." + (S.trajectoriesMore ? " Showing the first 200." : "")),
    body);
}

function viewTrajectory() {
  const main = $("main");
  const t = S.trajectory;
  if (!t) { main.replaceChildren(h("h1", {}, S.route.id), h("p", { class: "muted" }, "Loading…")); return; }
  if (t.error) {
    main.replaceChildren(h("p", {}, h("a", { href: "#/agents" }, "← Agents")), h("h1", { class: "mono" }, t.id), h("div", { class: "empty" }, t.error.message));
    return;
  }
  const facts = h("dl", { class: "facts", id: "trajectory-facts" },
    h("dt", {}, "State"), h("dd", { id: "trajectory-state" }, badge(t.state.toLowerCase())),
    h("dt", {}, "Task"), h("dd", { id: "trajectory-task", class: "task" }, t.task),
    h("dt", {}, "Run at the gate"), h("dd", {}, h("a", { href: runHref(t.id), class: "mono" }, t.id)),
    t.parent ? [h("dt", {}, "Parent run"), h("dd", {}, h("a", { href: runHref(t.parent), class: "mono" }, t.parent))] : null,
    t.retry_of ? [h("dt", {}, "Retry of"), h("dd", {}, h("a", { href: trajectoryHref(t.retry_of), class: "mono" }, t.retry_of))] : null,
    h("dt", {}, "Model"), h("dd", {}, t.model),
    h("dt", {}, "Turns"), h("dd", {}, String(t.turns)),
    h("dt", {}, "Budget stage"), h("dd", { id: "trajectory-stage" }, stageText(t.budget)),
    h("dt", {}, "Started"), h("dd", {}, when(t.started_at_ms)),
    t.ended_at_ms ? [h("dt", {}, "Ended"), h("dd", {}, when(t.ended_at_ms))] : null,
    h("dt", {}, "Exit"), h("dd", { id: "trajectory-exit" }, exitText(t.exit)),
    t.contract ? [h("dt", {}, "Task contract"), h("dd", { id: "trajectory-contract", class: "mono" }, JSON.stringify(t.contract))] : null,
    t.check ? [h("dt", {}, "Completion check"), h("dd", { id: "trajectory-check" }, checkText(t.check))] : null);
  const leases = (t.leases || []).map((l) => h("li", {}, l.kind, " ", h("span", { class: "mono" }, l.id)));
  const work = [
    ...t.pending.map((p) => h("li", {}, h("span", { class: "mono" }, p.call), " ", p.tool, " — ", p.phase, p.deadline_ms ? " (deadline " + when(p.deadline_ms) + ")" : "")),
    ...t.held.map((x) => h("li", {}, h("span", { class: "mono" }, x.call), " ", x.tool, " — held for approval, expires ", when(x.expires_at_ms),
      // An HTTP tool's request held at the gate: what the approval is for, and where it is.
      x.request ? [" — its request ", h("span", { class: "mono" }, `${x.request.tool} ${x.request.url}`), ", effect ",
        h("a", { href: runHref(x.request.run) }, h("span", { class: "mono" }, x.request.run)), " ", h("span", { class: "mono" }, x.request.key)] : null)),
  ];
  main.replaceChildren(...[
    h("p", {}, h("a", { href: "#/agents" }, "← Agents")),
    h("h1", {}, "Trajectory ", h("span", { class: "mono" }, t.id)),
    h("div", { class: "panel" }, facts),
    trajectoryActions(t),
    h("h2", {}, "Budget"), budgetView(t.budget),
    h("h2", {}, "Pending work"), work.length ? h("ul", { id: "trajectory-work" }, work) : h("p", { class: "muted" }, "Nothing in flight or held."),
    h("h2", {}, "Leases"), leases.length ? h("ul", { id: "trajectory-leases" }, leases) : h("p", { class: "muted" }, "None held."),
    childrenView(t),
    h("h2", {}, "Control requests"), t.control.length ? h("ul", { id: "trajectory-control" }, t.control.map((c) => h("li", {}, controlText(c)))) : h("p", { class: "muted" }, "None stored."),
    t.answer ? [h("h2", {}, "Last model message"), h("pre", { id: "trajectory-answer" }, t.answer)] : null,
  ].flat().filter(Boolean));
}

function render() {
  const route = S.route;
  for (const [id, v] of [["nav-inbox", "inbox"], ["nav-runs", "runs"], ["nav-agents", "trajectories"]]) {
    const a = $(id);
    if ((route.view === v) || (v === "runs" && route.view === "run") || (v === "trajectories" && route.view === "trajectory")) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  const c = $("inbox-count");
  c.textContent = String(S.pending.length);
  c.className = "count" + (S.pending.length ? "" : " zero");
  document.title = (S.pending.length ? `(${S.pending.length}) ` : "") + "estop console";
  // Keep what the user is typing: do not redraw a view while focus is in one of its inputs.
  const active = document.activeElement;
  const typing = active && (active.tagName === "INPUT" || active.tagName === "TEXTAREA") && $("main").contains(active);
  if (typing && (active.value || active.closest(".confirm"))) return;
  // Redraw only what changed, and give focus back to the same control (keyboard users).
  const sig = JSON.stringify([route, S.pending, route.view === "runs" ? S.runs : null, route.view === "run" ? S.run : null,
    route.view === "trajectories" ? [S.trajectories, S.trajectoriesError] : null, route.view === "trajectory" ? S.trajectory : null]);
  if (sig === S.drawn) return;
  S.drawn = sig;
  const focusKey = active && active.dataset ? active.dataset.focus : null;
  if (route.view === "inbox") viewInbox();
  else if (route.view === "runs") viewRuns();
  else if (route.view === "trajectories") viewTrajectories();
  else if (route.view === "trajectory") viewTrajectory();
  else viewRun();
  if (focusKey) {
    const again = [...document.querySelectorAll("[data-focus]")].find((el) => el.dataset.focus === focusKey);
    if (again) again.focus();
  }
}

// ---------- login ----------

function showLogin(message) {
  S.me = null;
  forget();
  if (S.events) { S.events.abort(); S.events = null; }
  $("nav").hidden = true;
  $("who").hidden = true;
  const token = h("input", { id: "token", type: "password", autocomplete: "off", class: "grow", required: true, "aria-describedby": "token-help" });
  const form = h("form", { class: "panel" },
    h("label", { for: "token" }, "Token"),
    h("p", { id: "token-help", class: "muted" }, "Open the one-time link that ", h("code", {}, "estop serve"), " wrote to ", h("code", {}, "DATA/console-login"), ", or paste a token: the contents of ", h("code", {}, "DATA/operator.token"), ", or one made by ", h("code", {}, "estop token create NAME --role operator"), ". Each browser tab keeps its own session."),
    h("div", { class: "row" }, token, h("button", { type: "submit", class: "approve" }, "Log in")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      const login = await api("POST", "/api/v1/session", { token: token.value.trim() });
      token.value = "";
      keep(login);
      S.me = login;
      start();
    } catch (e) { toast(e.message, true); }
  });
  $("main").replaceChildren(h("div", { class: "narrow" }, h("h1", {}, "Log in to estop"), message ? h("p", {}, message) : null, form));
  token.focus();
}

async function start() {
  $("nav").hidden = false;
  $("who").hidden = false;
  $("principal").replaceChildren(...textNodes(`${S.me.principal} (${S.me.role})`));
  S.route = parseRoute();
  render();
  connectEvents();
  await refresh(true);
}

// A one-time login link is /login#code=…: the code never goes in a request line; the page
// posts it, keeps the session it gets, and leaves the code out of the history.
async function redeemLink() {
  const code = new URLSearchParams(location.hash.replace(/^#/, "")).get("code");
  history.replaceState(null, "", "/");
  if (!code) return showLogin("");
  try {
    const login = await api("POST", "/api/v1/session", { code });
    keep(login);
    S.me = login;
    start();
  } catch (e) {
    showLogin(e.status === 401 ? "This login link was used or has expired: log in with a token, or ask for a new link." : e.message);
  }
}

async function boot() {
  $("logout").addEventListener("click", async () => {
    try { await api("DELETE", "/api/v1/session"); } catch (_) { /* ended anyway */ }
    showLogin("Logged out.");
  });
  if (location.pathname === "/login") return redeemLink();
  if (!stored()) return showLogin("");
  try {
    S.me = await api("GET", "/api/v1/session");
    start();
  } catch (e) {
    showLogin(e.status === 401 ? "Your session ended: log in again." : e.message);
  }
}

// ---------- keyboard and clocks ----------

document.addEventListener("keydown", (ev) => {
  if (ev.ctrlKey || ev.metaKey || ev.altKey || !S.me) return;
  const t = ev.target;
  if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT")) return;
  if (ev.key === "i") { location.hash = "#/inbox"; }
  else if (ev.key === "r") { location.hash = "#/runs"; }
  else if (ev.key === "/") {
    ev.preventDefault();
    if (S.route.view !== "runs") location.hash = "#/runs";
    setTimeout(() => $("search")?.focus(), 50);
  } else if (ev.key === "j" || ev.key === "k") {
    const cards = [...document.querySelectorAll("article.card")];
    if (!cards.length) return;
    const i = cards.findIndex((c) => c.contains(document.activeElement));
    const next = ev.key === "j" ? Math.min(cards.length - 1, i + 1) : Math.max(0, i < 0 ? 0 : i - 1);
    // The card itself: Tab then reaches its reason, Approve and Reject.
    cards[next].focus();
    cards[next].scrollIntoView({ block: "nearest" });
  }
});

setInterval(() => {
  for (const el of document.querySelectorAll("[data-expires]")) {
    const at = Number(el.getAttribute("data-expires"));
    el.textContent = left(at);
    el.classList.toggle("soon", at - Date.now() < 60000);
  }
}, 1000);

boot();
