// `estop mcp` between the official TypeScript MCP SDK's client and an upstream on the same SDK
// (test/mcp/upstream.ts): the binary on stdio and over streamable HTTP (`--listen`), the
// daemon real, the upstream's log the proof of what reached it.
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { after, test } from "node:test";
import { fileURLToPath } from "node:url";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { CallToolResultSchema } from "@modelcontextprotocol/sdk/types.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { findBinary } from "../src/testing.js";
import { daemonPerFile, runId } from "./helpers.js";

const POLICY = `
[defaults]
unknown_tool = "deny"

[[rules]]
tool = "ts__add"
when = 'args.a == 99'
action = "approve"

[[rules]]
tool = "ts__add"
action = "allow"

[[rules]]
tool = "ts__pay"
action = "deny"
`;

const daemon = daemonPerFile({ policy: POLICY });
const UPSTREAM = join(dirname(fileURLToPath(import.meta.url)), "mcp", "upstream.js");
const children: ChildProcess[] = [];
after(() => children.forEach((c) => c.kill()));

/** A gateway config fronting the TS upstream, and the upstream's log. */
function gateway(): { config: string; log: string } {
  const dir = mkdtempSync(join(tmpdir(), "estop-ts-mcp-"));
  const log = join(dir, "upstream.log");
  writeFileSync(log, "");
  const config = join(dir, "mcp.toml");
  writeFileSync(
    config,
    `[[server]]\nname = "ts"\ncommand = ${JSON.stringify(process.execPath)}\n` +
      `args = [${JSON.stringify(UPSTREAM)}]\nenv = { FIXTURE_LOG = ${JSON.stringify(log)} }\n`,
  );
  return { config, log };
}

const lines = (log: string) => readFileSync(log, "utf8").split("\n").filter((l) => l !== "");
const text = (r: any) => (r.content as any[]).map((c) => c.text ?? "").join("");

/** The same calls through either front: allowed and replayed, denied never sent. */
async function gated(client: Client, log: string): Promise<void> {
  const tools = await client.listTools();
  assert.deepEqual(tools.tools.map((t) => t.name).sort(), ["ts__add", "ts__pay"]);
  assert.equal(text(await client.callTool({ name: "ts__add", arguments: { a: 2, b: 3 } })), "5");
  assert.equal(text(await client.callTool({ name: "ts__add", arguments: { a: 2, b: 3 } })), "5");
  const denied = await client.callTool({ name: "ts__pay", arguments: { amount: 5 } });
  assert.equal(denied.isError, true);
  assert.match(text(denied), /^REFUSED, not run: denied/);
  assert.deepEqual(lines(log), ["call add 2 3"], "the repeat was replayed, the denied call never sent");
}

test("the TypeScript SDK's client on stdio, through estop mcp, to a TypeScript SDK upstream", async () => {
  const d = daemon.get();
  const { config, log } = gateway();
  const client = new Client({ name: "ts-test", version: "1.0.0" });
  await client.connect(
    new StdioClientTransport({
      command: findBinary(),
      args: ["mcp", "--config", config, "--data", d.data, "--run", runId("ts-mcp")],
    }),
  );
  try {
    await gated(client, log);
  } finally {
    await client.close();
  }
});

test("the TypeScript SDK's client over streamable HTTP, with and without an agent token", async () => {
  const d = daemon.get();
  const { config, log } = gateway();
  const proc = spawn(findBinary(), ["mcp", "--config", config, "--data", d.data, "--listen", "127.0.0.1:0"], {
    stdio: ["ignore", "ignore", "pipe"],
  });
  children.push(proc);
  // Ready once it says where it serves (after its upstreams started).
  const url = await new Promise<string>((resolve, reject) => {
    const rl = createInterface({ input: proc.stderr! });
    rl.on("line", (l) => {
      const m = /serving MCP on (\S+)/.exec(l);
      if (m?.[1]) resolve(m[1]);
    });
    proc.on("exit", (code) => reject(new Error(`estop mcp exited ${code}`)));
  });
  const anonymous = new Client({ name: "ts-anon", version: "1.0.0" });
  await assert.rejects(anonymous.connect(new StreamableHTTPClientTransport(new URL(url))));
  const token = readFileSync(join(d.data, "agent.token"), "utf8").trim();
  const client = new Client({ name: "ts-http", version: "1.0.0" });
  const transport = new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
  });
  await client.connect(transport);
  assert.equal(transport.protocolVersion, "2025-11-25", "the SDK's latest revision, agreed");
  try {
    await gated(client, log);
  } finally {
    await client.close();
  }
});

/** Waits until the run has one pending approval: its key. */
async function pendingKey(run: string): Promise<string> {
  const d = daemon.get();
  const deadline = Date.now() + 30_000;
  for (;;) {
    const items = await d.operator.pending(run);
    if (items.length === 1) return String(items[0]!.key);
    assert.ok(Date.now() < deadline, `no pending approval in ${run}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

test("the TypeScript SDK's client asks 2025-11-25's tasks: held, approved, denied, cancelled", async () => {
  const d = daemon.get();
  const { config, log } = gateway();
  const run = runId("ts-mcp-tasks");
  const client = new Client({ name: "ts-tasks", version: "1.0.0" });
  await client.connect(
    new StdioClientTransport({ command: findBinary(), args: ["mcp", "--config", config, "--data", d.data, "--run", run] }),
  );
  try {
    assert.ok(client.getServerCapabilities()?.tasks?.requests?.tools?.call, "the tasks capability");
    const tools = await client.listTools();
    assert.ok(tools.tools.every((t) => t.execution?.taskSupport === "optional"), "each tool takes a task");
    const stream = (args: Record<string, number>, name = "ts__add") =>
      client.experimental.tasks.callToolStream({ name, arguments: args }, CallToolResultSchema, { task: { ttl: 60_000 } });

    // Held: a task at once; the operator approves on estop's channel; the result follows.
    const seen: string[] = [];
    let result: any;
    for await (const m of stream({ a: 99, b: 1 })) {
      if (m.type === "taskCreated") {
        seen.push(`created ${m.task.status}`);
        assert.match(m.task.statusMessage ?? "", /estop approve/);
        assert.deepEqual(lines(log), [], "held: nothing ran");
        await d.operator.approve(run, await pendingKey(run));
      } else if (m.type === "result") {
        result = m.result;
      } else if (m.type === "error") {
        throw m.error;
      }
    }
    assert.deepEqual(seen, ["created working"]);
    assert.equal(text(result), "100");
    assert.deepEqual(lines(log), ["call add 99 1"]);

    // Denied: the task ends `failed` (an isError result, in this revision), its reason in the
    // status message; nothing is sent upstream.
    let failed: any;
    for await (const m of stream({ amount: 5 }, "ts__pay")) {
      if (m.type === "taskStatus") failed = m.task;
    }
    assert.equal(failed?.status, "failed");
    assert.match(failed?.statusMessage ?? "", /^REFUSED, not run: denied/);

    // Cancelled while held: nothing runs.
    let cancelled: any;
    for await (const m of stream({ a: 99, b: 2 })) {
      if (m.type === "taskCreated") {
        cancelled = await client.experimental.tasks.cancelTask(m.task.taskId);
      }
    }
    assert.equal(cancelled?.status, "cancelled");
    assert.deepEqual(lines(log), ["call add 99 1"], "the cancelled call never ran");
    const listed = await client.experimental.tasks.listTasks();
    assert.equal(listed.tasks.length, 3);
    // The cancelled call's approval stays pending until an operator clears it.
    await d.operator.reject(run, await pendingKey(run));
  } finally {
    await client.close();
  }
});
