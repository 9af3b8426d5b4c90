// estop for TypeScript: the protocol v1 client, runs, the effect wrapper and the watcher.
// Adapters live under "estop/langgraph", "estop/ai" and "estop/openai-agents".
export { Client, LINE_BYTES_MAX, REPLY_BYTES_MAX } from "./client.js";
export type { ClientOptions, CallOptions, AdmitOptions, Declare, GateEvent, EventListener, RunLimits, Spend } from "./client.js";
export { CompensationWorker, CompensationUnknown } from "./compensation.js";
export type { CompensationHandler, CompensationWorkerOptions, Reported } from "./compensation.js";
export { resolveConfig, parseAddr } from "./config.js";
export type { Config, Endpoint } from "./config.js";
export * from "./errors.js";
export { canonical, digest, toJson } from "./jcs.js";
export type { Json } from "./jcs.js";
export { deriveKey, callKey } from "./keys.js";
export { parseVerdict } from "./verdicts.js";
export type { Verdict, Admitted, Go, Held, RefusedVerdict, BudgetRefusal, Duplicate } from "./verdicts.js";
export { Estop, Run, Step, requireRun } from "./run.js";
export type { EstopOptions, RunOptions } from "./run.js";
export { gate, runEffect, effectKey, wrap, identityArgs } from "./effect.js";
export type { EffectOptions, WrapOptions, Gated } from "./effect.js";
