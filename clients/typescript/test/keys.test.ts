// Keys: the Python client's format for the same inputs, and call-id keys that are always ids the
// gate accepts (no hidden characters, at most 200 bytes), stable for the same call.
import assert from "node:assert/strict";
import { test } from "node:test";
import { callKey, deriveKey } from "../src/index.js";
import { daemonPerFile, runId } from "./helpers.js";

const daemon = daemonPerFile();

test("deriveKey matches the Python client's derive_key", () => {
  // python: derive_key("r1", "run", "refund", "ab"*32, 2) (clients/python/src/estop/keys.py)
  assert.equal(deriveKey("r1", "run", "refund", "ab".repeat(32), 2), "run:refund:2:59af2077c1f18ff2bf410422");
});

test("call keys: readable when the id is, hashed when it is hidden-charactered or long, stable", async () => {
  assert.equal(callKey("wire_money", "call_abc"), "call:wire_money:call_abc");
  const bidi = callKey("wire_money", "call\u202eevil");
  assert.match(bidi, /^call:wire_money:[0-9a-f]{32}$/);
  assert.equal(bidi, callKey("wire_money", "call\u202eevil"));
  const long = callKey("t", "x".repeat(500));
  assert.ok(Buffer.byteLength(long) <= 200);
  assert.notEqual(long, callKey("t", "x".repeat(499)));
  // The gate takes each of them as a key.
  const c = daemon.get().client();
  const run = runId();
  for (const key of [bidi, long, callKey("t", "é".repeat(90))]) {
    assert.equal((await c.admit(run, key, "lookup_k", { args: {} })).kind, "admitted", key);
  }
});
