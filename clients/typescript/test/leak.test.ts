// Every leak scenario once per adapter, against a real `estop serve`: without estop the hole is
// there (each scenario is built to reach it), with the adapter nothing leaks and the run goes on
// after an interrupt. scripts/leak-table.ts runs the same scenarios 20 times per cell.
import assert from "node:assert/strict";
import { test } from "node:test";
import { setTracingDisabled } from "@openai/agents";
import { FRAMEWORKS } from "../scripts/leak/frameworks.js";
import { CLASSES, newTrial } from "../scripts/leak/common.js";
import { daemonPerFile } from "./helpers.js";

setTracingDisabled(true);
const daemon = daemonPerFile();

for (const [name, fw] of Object.entries(FRAMEWORKS)) {
  for (const k of CLASSES) {
    test(`${name} ${k}: ${k === "interrupt_continue" ? "the run goes on after an interrupt" : "leaks without estop, not with it"}`, async () => {
      const d = daemon.get();
      const gate = d.gate();
      const without = await fw.scenarios[k](newTrial(d, gate, false));
      const withEstop = await fw.scenarios[k](newTrial(d, gate, true));
      assert.equal(withEstop, 0, `${name} ${k} leaked with estop`);
      if (k === "interrupt_continue") assert.equal(without, 0);
      else assert.ok(without > 0, `${name} ${k}: the scenario did not reach the hole without estop`);
    });
  }
}
