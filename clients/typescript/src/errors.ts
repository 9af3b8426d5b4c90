// Errors: gate errors by the protocol's stable codes, refusals by reason, connection trouble.
// Every class has a stable `code` so callers can switch on it without `instanceof`.
import type { Held } from "./verdicts.js";

/** Base class of everything this package throws. */
export class EstopError extends Error {
  readonly code: string;
  constructor(code: string, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.code = code;
    this.name = new.target.name;
  }
}

/** The gate could not be reached (after the reconnect attempts), or it hung up mid-request. */
export class ConnectionLost extends EstopError {
  constructor(message: string, options?: { cause?: unknown }) {
    super("connection_lost", message, options);
  }
}

/** The gate sent something that is not protocol v1 (a line over `replyBytesMax`, not JSON). */
export class ProtocolViolation extends EstopError {
  constructor(message: string) {
    super("protocol_violation", message);
  }
}

/**
 * No reply within the client's timeout. The request may or may not have been applied (every
 * agent verb is safe to repeat with the same key). It interrupts this call only: the run goes on.
 */
export class EstopTimeout extends EstopError {
  constructor(message: string) {
    super("timeout", message);
  }
}

/**
 * The caller's AbortSignal fired. Like a timeout it interrupts this call only; the run is not
 * cancelled (only `run.cancel()` or an operator does that). `reason` is the signal's reason.
 */
export class Aborted extends EstopError {
  readonly reason: unknown;
  constructor(reason: unknown) {
    super("aborted", `aborted by the caller${reason instanceof Error ? `: ${reason.message}` : ""}`, { cause: reason });
    this.reason = reason;
  }
}

/** The gate answered `ok: false`; `code` is one of docs/PROTOCOL.md's error codes. */
export class GateError extends EstopError {
  readonly reply: Record<string, unknown>;
  readonly gateMessage: string;
  constructor(code: string, message: string, reply: Record<string, unknown> = {}) {
    super(code, `${code}: ${message}`);
    this.gateMessage = message;
    this.reply = reply;
  }
}
/** bad_json, unknown_op, missing_field, invalid_field, line_too_long, args_required. */
export class InvalidRequest extends GateError {}
export class Unauthenticated extends GateError {}
export class Forbidden extends GateError {}
export class NotFound extends GateError {}
export class NotPending extends GateError {}
export class BadToken extends GateError {}
export class Conflict extends GateError {}
export class LimitExceeded extends GateError {}
export class Unavailable extends GateError {}
export class Internal extends GateError {}

const BY_CODE: Record<string, new (code: string, message: string, reply?: Record<string, unknown>) => GateError> = {
  bad_json: InvalidRequest,
  unknown_op: InvalidRequest,
  missing_field: InvalidRequest,
  invalid_field: InvalidRequest,
  line_too_long: InvalidRequest,
  args_required: InvalidRequest,
  unauthenticated: Unauthenticated,
  forbidden: Forbidden,
  not_found: NotFound,
  not_pending: NotPending,
  bad_token: BadToken,
  conflict: Conflict,
  limit_exceeded: LimitExceeded,
  unavailable: Unavailable,
  internal: Internal,
};

/** The typed error of an `ok: false` reply (an unknown code is a plain GateError). */
export function errorFromReply(reply: Record<string, unknown>): GateError {
  const err = (reply.error ?? {}) as { code?: unknown; message?: unknown };
  const code = typeof err.code === "string" ? err.code : "internal";
  const message = typeof err.message === "string" ? err.message : JSON.stringify(reply);
  const Cls = BY_CODE[code] ?? GateError;
  return new Cls(code, message, reply);
}

export interface EffectRef {
  run: string;
  key?: string | undefined;
  tool?: string | undefined;
}

/** The gate refused the effect: never, for this call. `reason` is the protocol's. */
export class Refused extends EstopError {
  readonly reason: string;
  readonly run: string;
  readonly key: string | undefined;
  readonly tool: string | undefined;
  readonly rule: string | undefined;
  constructor(reason: string, ref: EffectRef, detail?: { message?: string | undefined; rule?: string | undefined }) {
    super(reason, `${ref.tool ?? "effect"} refused (${reason}) in run ${JSON.stringify(ref.run)}${detail?.message ? `: ${detail.message}` : ""}`);
    this.reason = reason;
    this.run = ref.run;
    this.key = ref.key;
    this.tool = ref.tool;
    this.rule = detail?.rule;
  }
}
/** The run is stopped (cancelled, killed, closed, past its deadline or budget). */
export class RunStopped extends Refused {
  /** true when this process knew before asking the gate (the local fence). */
  readonly local: boolean;
  constructor(reason: string, ref: EffectRef, local = false, message?: string) {
    super(reason, ref, { message });
    this.local = local;
  }
}
/** An operator rejected it (or the same call earlier in the run), or its approval expired. */
export class Rejected extends Refused {}
/** Policy denies the tool. */
export class Denied extends Refused {}
/** The key was used before with other arguments. */
export class Mismatch extends Refused {}

const STOP_REASONS = new Set(["cancelled", "closed", "deadline", "budget", "killed"]);

/** The typed refusal for a protocol refusal reason. */
export function refusal(reason: string, ref: EffectRef, message?: string, rule?: string): Refused {
  if (STOP_REASONS.has(reason)) return new RunStopped(reason, ref, false, message);
  if (reason === "rejected" || reason === "expired") return new Rejected(reason, ref, { message, rule });
  if (reason === "denied") return new Denied(reason, ref, { message, rule });
  if (reason === "mismatch") return new Mismatch(reason, ref, { message, rule });
  return new Refused(reason, ref, { message, rule });
}

/** The effect is held (approval, sibling, pause) and the caller asked not to wait. */
export class HeldForApproval extends EstopError {
  readonly run: string;
  readonly key: string;
  readonly tool: string;
  readonly held: Held;
  constructor(run: string, key: string, tool: string, held: Held) {
    super("held", `${tool} in run ${JSON.stringify(run)} is held (${held.reason}); decide it with \`estop approve ${run} ${key}\` or \`estop reject ...\``);
    this.run = run;
    this.key = key;
    this.tool = tool;
    this.held = held;
  }
}

/** A duplicate whose first attempt started and never reported: it may or may not have happened. */
export class InDoubt extends EstopError {
  constructor(readonly run: string, readonly key: string, readonly status: string) {
    super("in_doubt", `effect ${key} of run ${JSON.stringify(run)} is ${status}: the first attempt never reported; check before retrying under a new key`);
  }
}

/** A duplicate whose first attempt failed: the recorded error. */
export class EffectFailed extends EstopError {
  constructor(readonly run: string, readonly key: string, readonly error: string | undefined) {
    super("effect_failed", `effect ${key} of run ${JSON.stringify(run)} failed before: ${error ?? "(no message)"}`);
  }
}

/** An effect was called outside any run. */
export class NoRun extends EstopError {
  constructor(what: string) {
    super("no_run", `${what} called outside a run: use gate.run(id).enter(() => ...) or pass { run }`);
  }
}
