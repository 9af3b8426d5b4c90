// Shared by the tests: a policy with one tool of each kind, fresh run ids, and a daemon per file.
import { randomUUID } from "node:crypto";
import { after, before } from "node:test";
import { Daemon, DEFAULT_POLICY, type DaemonOptions } from "../src/testing.js";

export const POLICY = `${DEFAULT_POLICY}
[[rules]]
tool = "forbidden_tool"
action = "deny"
`;

export function runId(prefix = "ts"): string {
  return `${prefix}-${randomUUID().slice(0, 8)}`;
}

/** Starts one `estop serve` for the test file (before) and stops it (after). */
export function daemonPerFile(opts: DaemonOptions = {}): { get: () => Daemon } {
  let d: Daemon | undefined;
  before(async () => {
    d = await Daemon.start({ policy: POLICY, ...opts });
  });
  after(async () => {
    await d?.stop();
  });
  return {
    get: () => {
      if (!d) throw new Error("daemon not started");
      return d;
    },
  };
}

/** Resolves on the first event `pred` accepts (the operator's view of the gate). */
export function nextEvent<T>(subscribe: (fn: (e: T) => void) => () => void, pred: (e: T) => boolean): Promise<T> {
  return new Promise((resolve) => {
    const off = subscribe((e) => {
      if (pred(e)) {
        off();
        resolve(e);
      }
    });
  });
}
