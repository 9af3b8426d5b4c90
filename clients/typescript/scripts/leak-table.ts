// Prints the leak table: adapter × failure class, trials that leaked without estop (the
// framework alone) and with its estop adapter, over a real `estop serve` on a temp dir.
//
//   npm run build && node dist/scripts/leak-table.js [--trials 20] [--framework langgraph] [--klass sibling]
//
// Exits 1 if anything leaked with estop. The scenarios are in scripts/leak/ (see common.ts).
import { parseArgs } from "node:util";
import { setTracingDisabled } from "@openai/agents";
import { Daemon } from "../src/testing.js";
import { POLICY } from "../test/helpers.js";
import { CLASSES, newTrial } from "./leak/common.js";
import { FRAMEWORKS } from "./leak/frameworks.js";

async function main(): Promise<number> {
  const { values } = parseArgs({ options: { trials: { type: "string", default: "20" }, framework: { type: "string", multiple: true }, klass: { type: "string", multiple: true } } });
  const trials = Number(values.trials);
  const frameworks = values.framework ?? Object.keys(FRAMEWORKS);
  const classes = (values.klass ?? CLASSES) as Array<(typeof CLASSES)[number]>;
  setTracingDisabled(true);
  const t0 = Date.now();
  const d = await Daemon.start({ policy: POLICY });
  const gate = d.gate();
  const rows: Array<{ fw: string; guarded: boolean; cells: Record<string, number> }> = [];
  let leakedWith = 0;
  try {
    for (const fw of frameworks) {
      const spec = FRAMEWORKS[fw];
      if (!spec) throw new Error(`unknown framework ${fw}; one of ${Object.keys(FRAMEWORKS).join(", ")}`);
      for (const guarded of [false, true]) {
        const cells: Record<string, number> = {};
        for (const k of classes) {
          let leaked = 0;
          for (let i = 0; i < trials; i++) leaked += (await spec.scenarios[k](newTrial(d, gate, guarded))) > 0 ? 1 : 0;
          cells[k] = leaked;
          if (guarded) leakedWith += leaked;
          process.stderr.write(`  ${spec.label.padEnd(18)} ${guarded ? "with   " : "without"} ${k.padEnd(19)} ${leaked}/${trials}\n`);
        }
        rows.push({ fw: spec.label, guarded, cells });
      }
    }
  } finally {
    await d.stop();
  }
  console.log(`\nTrials that leaked / trials, ${trials} per cell (interrupt_continue: trials whose next turn could not act).\n`);
  console.log(`| adapter | ${classes.join(" | ")} |`);
  console.log(`|---|${classes.map(() => "---").join("|")}|`);
  for (const r of rows) {
    const cell = (k: string) => (r.guarded ? `**${r.cells[k]}/${trials}**` : `${r.cells[k]}/${trials}`);
    console.log(`| ${r.fw}, ${r.guarded ? "with estop" : "without"} | ${classes.map(cell).join(" | ")} |`);
  }
  console.log(`\n(${Math.round((Date.now() - t0) / 1000)} s)`);
  return leakedWith ? 1 : 0;
}

process.exitCode = await main();
