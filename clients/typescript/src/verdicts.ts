// Verdicts of `admit`, `wait` and `start` as a tagged union (docs/PROTOCOL.md, "Verdicts").
import type { Json } from "./jcs.js";
import { ProtocolViolation } from "./errors.js";

/** Go ahead (prepared, when admitted with `start: false`). */
export interface Admitted { kind: "admitted"; token: string; epoch: number }
/** `start` only: run it now. */
export interface Go { kind: "go" }
/** Not yet: `approval` (an operator decides), `sibling` (another effect awaits one), `paused`. */
export interface Held { kind: "held"; reason: "approval" | "sibling" | "paused" | string; approval: string | null; expiresAt: number | null }
/** Never, for this effect. */
export interface RefusedVerdict { kind: "refused"; reason: string; message?: string | undefined; rule?: string | undefined; budget?: BudgetRefusal | undefined }
/** Reason `budget` of a `reserve`: the dimension, the nearest run whose limit it would pass, that limit and what was used. */
export interface BudgetRefusal { dimension: string; run: string; limit: number; used: number }
/** This identity was admitted before: its recorded status and outcome. */
export interface Duplicate { kind: "duplicate"; status: string; outcome?: string | undefined; result?: Json | undefined; error?: string | undefined }

export type Verdict = Admitted | Go | Held | RefusedVerdict | Duplicate;

const str = (v: unknown): string | undefined => (typeof v === "string" ? v : undefined);

function budgetRefusal(v: unknown): BudgetRefusal | undefined {
  if (typeof v !== "object" || v === null) return undefined;
  const b = v as Record<string, unknown>;
  if (typeof b.dimension !== "string" || typeof b.run !== "string" || typeof b.limit !== "number" || typeof b.used !== "number") return undefined;
  return { dimension: b.dimension, run: b.run, limit: b.limit, used: b.used };
}

/** The verdict of an `ok: true` reply; anything else is a protocol violation, never a guess. */
export function parseVerdict(reply: Record<string, unknown>): Verdict {
  switch (reply.verdict) {
    case "admitted":
      if (typeof reply.token !== "string") break;
      return { kind: "admitted", token: reply.token, epoch: typeof reply.epoch === "number" ? reply.epoch : 0 };
    case "go":
      return { kind: "go" };
    case "held":
      return {
        kind: "held",
        reason: str(reply.reason) ?? "approval",
        approval: str(reply.approval) ?? null,
        expiresAt: typeof reply.expires_at === "number" ? reply.expires_at : null,
      };
    case "refused":
      return { kind: "refused", reason: str(reply.reason) ?? "refused", message: str(reply.message), rule: str(reply.rule), budget: budgetRefusal(reply.budget) };
    case "duplicate":
      return {
        kind: "duplicate",
        status: str(reply.status) ?? "unknown",
        outcome: str(reply.outcome),
        result: reply.result as Json | undefined,
        error: str(reply.error),
      };
  }
  throw new ProtocolViolation(`reply has no verdict this client knows: ${JSON.stringify(reply).slice(0, 200)}`);
}
