// A gate that misbehaves (a fake one on a Unix socket): an oversize reply, a reply that is not
// JSON, another protocol version, silence, and a hang-up after a non-idempotent request. Each
// ends in a typed error, with memory bounded, and nothing is re-sent that must not be.
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";
import { Client, ConnectionLost, EstopTimeout, ProtocolViolation } from "../src/index.js";

const dir = mkdtempSync(join(tmpdir(), "estop-fake-"));
const servers: Server[] = [];
after(() => {
  for (const s of servers) s.close();
  rmSync(dir, { recursive: true, force: true });
});

/** A fake gate: `answer(request, socket)` for each request line after a good hello. */
async function fake(name: string, answer: (req: Record<string, unknown>, sock: Socket) => void, hello: Record<string, unknown> = { role: "agent", principal: "agent", protocol: 1 }): Promise<string> {
  const path = join(dir, `${name}.sock`);
  const server = createServer((sock) => {
    let buf = "";
    sock.on("data", (d) => {
      buf += d.toString();
      for (let i = buf.indexOf("\n"); i >= 0; i = buf.indexOf("\n")) {
        const req = JSON.parse(buf.slice(0, i)) as Record<string, unknown>;
        buf = buf.slice(i + 1);
        if (req.op === "hello") sock.write(`${JSON.stringify({ id: req.id, ok: true, ...hello })}\n`);
        else answer(req, sock);
      }
    });
    sock.on("error", () => {});
  });
  servers.push(server);
  await new Promise<void>((r) => server.listen(path, r));
  return path;
}

const opts = { token: "t", reconnectAttempts: 2, backoffInitialMs: 5, connectTimeoutMs: 300 };

test("an oversize reply ends the connection with ProtocolViolation, without buffering it", async () => {
  let sent = 0;
  const socket = await fake("oversize", (req, sock) => {
    // 4 MiB with no newline, in 64 KiB chunks: the client must stop at replyBytesMax.
    const chunk = `{"id":${String(req.id)},"ok":true,"pad":"${"x".repeat(65_536)}`;
    const pump = () => {
      while (sent < 64 && sock.write(chunk)) sent++;
      if (sent < 64 && !sock.destroyed) sock.once("drain", pump);
    };
    pump();
  });
  const c = new Client({ ...opts, socket, replyBytesMax: 256 * 1024 });
  await assert.rejects(c.status("r"), (e: unknown) => e instanceof ProtocolViolation && /over replyBytesMax 262144/.test(e.message));
  assert.ok(sent < 64, `the client hung up early (${sent} of 64 chunks written)`);
  c.close();
});

test("a reply that is not JSON is a ProtocolViolation", async () => {
  const socket = await fake("garbage", (_req, sock) => sock.write("HTTP/1.1 400 Bad Request\n"));
  const c = new Client({ ...opts, socket });
  await assert.rejects(c.ping(), ProtocolViolation);
  c.close();
});

test("a gate that speaks another protocol version is refused at hello", async () => {
  const socket = await fake("v2", () => {}, { role: "agent", principal: "agent", protocol: 2 });
  const c = new Client({ ...opts, socket });
  await assert.rejects(c.ping(), (e: unknown) => e instanceof ProtocolViolation && /protocol 2/.test(e.message));
  c.close();
});

test("silence: the call times out; an unreachable gate is ConnectionLost after the attempts", async () => {
  const socket = await fake("silent", () => {});
  const c = new Client({ ...opts, socket, timeoutMs: 100 });
  await assert.rejects(c.ping(), EstopTimeout);
  c.close();
  const gone = new Client({ ...opts, socket: join(dir, "nobody.sock") });
  await assert.rejects(gone.ping(), (e: unknown) => e instanceof ConnectionLost && /after 2 attempts/.test(e.message));
});

test("a hang-up: idempotent requests are re-sent, a decide is not", async () => {
  const seen: Record<string, number> = {};
  const socket = await fake("hangup", (req, sock) => {
    const op = String(req.op);
    seen[op] = (seen[op] ?? 0) + 1;
    if (seen[op] === 1) return void sock.destroy(); // the first of each is lost with the connection
    sock.write(`${JSON.stringify({ id: req.id, ok: true, pong: true, status: "approved" })}\n`);
  });
  const c = new Client({ ...opts, socket });
  assert.equal(await c.ping(), true);
  assert.equal(seen.ping, 2);
  await assert.rejects(c.approve("r", "k"), ConnectionLost);
  assert.equal(seen.decide, 1);
  c.close();
});
