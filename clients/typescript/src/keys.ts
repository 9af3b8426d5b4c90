// Stable idempotency keys. A key from the framework's own call identity (a tool_call_id, a
// call_id) is stable across resume and retry; without one, run + logical step + tool + the
// call's digest + its occurrence in the step. The format is the Python client's (same inputs,
// same key), so a run driven from both languages agrees.
import { createHash } from "node:crypto";
import { canonical } from "./jcs.js";

const STEP_BYTES_MAX = 80;
const TOOL_BYTES_MAX = 60;
const KEY_BYTES_MAX = 200;

// What the gate refuses in an id (docs/PROTOCOL.md "Ids must look like what they are"): C0/C1
// controls, DEL, bidi controls, zero-width and invisible characters, line/paragraph separators.
const HIDDEN_CLASS = "[\\u0000-\\u001f\\u007f-\\u009f\\u061c\\u200b-\\u200f\\u202a-\\u202e\\u2028\\u2029\\u2060-\\u2064\\u2066-\\u2069\\ufeff]";
const HIDDEN_ALL = new RegExp(HIDDEN_CLASS, "gu");
const HIDDEN_ANY = new RegExp(HIDDEN_CLASS, "u");

function clip(text: string, limit: number): string {
  const clean = text.replace(HIDDEN_ALL, "?");
  const b = Buffer.from(clean, "utf8");
  if (b.length <= limit) return clean;
  // Cut at a character boundary: drop a partial UTF-8 sequence at the end.
  let end = limit;
  while (end > 0 && ((b[end] ?? 0) & 0xc0) === 0x80) end--;
  return b.subarray(0, end).toString("utf8");
}

/** The key of the `occurrence`-th call of `tool` with `digest` at `step` of `run`. */
export function deriveKey(run: string, step: string, tool: string, digestHex: string, occurrence = 1): string {
  const h = createHash("sha256").update(canonical([run, step, tool, digestHex, occurrence]), "utf8").digest("hex").slice(0, 24);
  return `${clip(step, STEP_BYTES_MAX)}:${clip(tool, TOOL_BYTES_MAX)}:${occurrence}:${h}`;
}

/**
 * The key of a framework tool call from its own call id (LangGraph's `tool_call_id`, the AI
 * SDK's `toolCallId`, the Agents SDK's `callId`): readable when the id is, always a valid gate
 * id, and the same for every retry and resume of that call.
 */
export function callKey(tool: string, callId: string): string {
  const readable = `call:${clip(tool, TOOL_BYTES_MAX)}:${callId}`;
  if (!HIDDEN_ANY.test(callId) && Buffer.byteLength(readable) <= KEY_BYTES_MAX) return readable;
  const h = createHash("sha256").update(canonical([tool, callId]), "utf8").digest("hex").slice(0, 32);
  return `call:${clip(tool, TOOL_BYTES_MAX)}:${h}`;
}
