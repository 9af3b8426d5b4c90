// The digest is the gate's: the protocol's test vector, RFC 8785's number and string rules, and
// the daemon itself (a digest-only admit of the same call is a duplicate; other args a mismatch).
import assert from "node:assert/strict";
import { test } from "node:test";
import { canonical, digest } from "../src/index.js";
import { daemonPerFile, runId } from "./helpers.js";

const daemon = daemonPerFile();

test("the protocol's test vector", () => {
  assert.equal(canonical({ tool: "refund", args: { amount: 10.0, to: "acct-1" } }), '{"args":{"amount":10,"to":"acct-1"},"tool":"refund"}');
  assert.equal(digest("refund", { amount: 10.0, to: "acct-1" }), "8833f3bd12786d1bfb0512eb3624a0de38e845d906c110a4bab60af53bbd1b96");
});

test("numbers as ECMAScript writes doubles", () => {
  const cases: Array<[number, string]> = [
    [0, "0"], [-0, "0"], [1e21, "1e+21"], [1e20, "100000000000000000000"], [1e-7, "1e-7"],
    [0.000001, "0.000001"], [123.456, "123.456"], [5e-324, "5e-324"],
    [1.7976931348623157e308, "1.7976931348623157e+308"], [2 ** 53 + 1, "9007199254740992"],
    [-1.5, "-1.5"], [333333333.3333333, "333333333.3333333"], [4.5e-5, "0.000045"],
  ];
  for (const [v, text] of cases) assert.equal(canonical(v), text, `canonical(${v})`);
});

test("strings and key order by UTF-16 code units", () => {
  assert.equal(canonical("a\u0001\n\"\\/é€"), '"a\\u0001\\n\\"\\\\/é€"');
  assert.equal(canonical({ "\uff5e": 1, "\u{1F600}": 2, a: 3 }), '{"a":3,"\u{1F600}":2,"\uff5e":1}');
  assert.equal(canonical([true, false, null, {}]), "[true,false,null,{}]");
  assert.equal(canonical({ b: undefined, a: new Date(0) }), '{"a":"1970-01-01T00:00:00.000Z"}');
});

test("what JSON cannot carry is refused, never sent as something else", () => {
  assert.throws(() => canonical(NaN), TypeError);
  assert.throws(() => canonical({ a: Infinity }), /non-finite/);
  assert.throws(() => canonical({ a: 1n }), /bigint/);
  const cyc: Record<string, unknown> = {};
  cyc.self = cyc;
  assert.throws(() => canonical(cyc), /cycle/);
});

test("the daemon computes the same digest", async () => {
  const c = daemon.get().client();
  const run = runId();
  const args = { amount: 1e21, when: 0.1, s: "\u2028é\u007f", nested: { b: [1, 2.5], a: null }, "\u{1F600}": 1, "\uff5e": 2 };
  const v = await c.admit(run, "k1", "noop", { args });
  assert.equal(v.kind, "admitted");
  assert.ok(v.kind === "admitted");
  await c.complete(run, "k1", v.token, "ok");
  const dup = await c.admit(run, "k1", "noop", { digest: digest("noop", args) });
  assert.equal(dup.kind, "duplicate");
  const mis = await c.admit(run, "k1", "noop", { digest: digest("noop", { ...args, amount: 1 }) });
  assert.deepEqual(mis.kind === "refused" && mis.reason, "mismatch");
});
