// The README's one-minute example runs as a new user would run it, and says what it should.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const examples = join(dirname(fileURLToPath(import.meta.url)), "..", "examples");

test("examples/quickstart: approved once, replayed as a receipt", async () => {
  const env = { ...process.env };
  delete env.ESTOP_SOCKET;
  const { stdout } = await promisify(execFile)(process.execPath, [join(examples, "quickstart.js")], { env, timeout: 60_000 });
  assert.match(stdout, /held: estop approve order-\d+ run:wire_money:1:/);
  assert.match(stdout, /refund: \{ refund: 're_ch_1', amount: 1999 \}/);
  assert.match(stdout, /again: \{ amount: 1999, refund: 're_ch_1' \}/);
  assert.match(stdout, /done: lookup_user, wire_money\n/);
});

for (const [name, answer] of [["langgraph", /paused: wire_money awaits an operator's approval[\s\S]*answer: Refund sent\./], ["ai-sdk", /approval requested: wire_money estop[\s\S]*answer: Refund sent\./], ["openai-agents", /paused on: wire_money\nanswer: Refund sent\./]] as const) {
  test(`examples/${name}: paused, approved in estop, answered`, async () => {
    const { stdout } = await promisify(execFile)(process.execPath, [join(examples, `${name}.js`)], { timeout: 60_000 });
    assert.match(stdout, answer);
  });
}
