// One minute with estop: a throwaway gate, an agent whose refund needs an operator's approval,
// and a lookup that does not. Run: npm run build && node dist/examples/quickstart.js
// (set ESTOP_SOCKET + ESTOP_TOKEN to use your own daemon and decide with `estop approve`).
import { Estop, Rejected } from "../src/index.js";
import { Daemon } from "../src/testing.js";

const own = process.env.ESTOP_SOCKET !== undefined;
const daemon = own ? undefined : await Daemon.start(); // starts `estop serve` on a temp dir
const gate = daemon ? daemon.gate() : new Estop();

// Any function becomes a gated effect: admitted by the gate before it runs.
const lookup = gate.effect(async ({ user }: { user: string }) => ({ user, balance: 42 }), { tool: "lookup_user" });
const refund = gate.effect(async ({ charge, amount }: { charge: string; amount: number }, signal: AbortSignal) => {
  signal.throwIfAborted(); // fires the moment the run is stopped, by anyone
  return { refund: `re_${charge}`, amount };
}, { tool: "wire_money" }); // the demo policy says wire_money needs an approval

const run = gate.run(`order-${Date.now()}`);
if (daemon) {
  // Play the operator: approve the first hold (a person would run `estop approve RUN KEY`).
  const op = daemon.operator;
  op.onEvent((e) => {
    if (e.event === "held" && e.reason === "approval") {
      console.log(`held: estop approve ${e.run} ${e.key}`);
      void op.approve(e.run, String(e.key));
    }
  });
  await op.subscribe(run.id);
}

await run.enter(async () => {
  console.log("lookup:", await lookup({ user: "ada" }));
  try {
    console.log("refund:", await refund({ charge: "ch_1", amount: 1999 }));
  } catch (e) {
    if (e instanceof Rejected) console.log("the operator rejected the refund");
    else throw e;
  }
  // The same call again (a retry, a replayed worker): the receipt, not a second refund.
  console.log("again:", await gate.run(run.id).enter(() => refund({ charge: "ch_1", amount: 1999 })).catch(String));
});
const report = await run.report();
console.log("done:", (report.done as Array<{ tool: string }>).map((e) => e.tool).join(", "));
await run.close();
if (daemon) await daemon.stop();
else gate.close();
