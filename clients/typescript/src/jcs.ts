// The effect digest, exactly the gate's: hex(SHA-256(JCS({"tool": tool, "args": args}))).
// JCS is RFC 8785. ECMAScript's own number and string serialisation *is* JCS's, so only key
// order (UTF-16 code units, which is what `<` on JS strings compares) and the refusal of what
// JSON cannot carry are done here (docs/PROTOCOL.md, "The effect digest").
import { createHash } from "node:crypto";

/** Any JSON value, as the protocol carries it. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/**
 * The JSON value a call's arguments are sent as (what `JSON.stringify` would send), refusing
 * what would be sent as something else silently: non-finite numbers, bigints, functions,
 * symbols and cycles. `toJSON` is honoured (a Date becomes its ISO string).
 */
export function toJson(value: unknown, path = "$", seen: Set<object> = new Set()): Json {
  if (value !== null && typeof value === "object" && typeof (value as { toJSON?: unknown }).toJSON === "function") {
    value = (value as { toJSON: () => unknown }).toJSON();
  }
  if (value === null) return null;
  switch (typeof value) {
    case "boolean":
    case "string":
      return value;
    case "number":
      if (!Number.isFinite(value)) throw new TypeError(`${path} is ${value}: JSON has no non-finite numbers`);
      return value;
    case "object":
      break;
    default:
      throw new TypeError(`${path} is a ${typeof value}, which JSON cannot carry`);
  }
  const obj = value as object;
  if (seen.has(obj)) throw new TypeError(`${path} is a cycle`);
  seen.add(obj);
  try {
    if (Array.isArray(obj)) {
      return obj.map((v, i) => (v === undefined || typeof v === "function" || typeof v === "symbol" ? null : toJson(v, `${path}[${i}]`, seen)));
    }
    const out: { [key: string]: Json } = {};
    for (const [k, v] of Object.entries(obj)) {
      if (v === undefined || typeof v === "function" || typeof v === "symbol") continue;
      out[k] = toJson(v, `${path}.${k}`, seen);
    }
    return out;
  } finally {
    seen.delete(obj);
  }
}

/** RFC 8785 canonical text of a JSON value. */
export function canonical(value: unknown): string {
  const v = toJson(value);
  return write(v);
}

function write(v: Json): string {
  if (v === null || typeof v !== "object") return JSON.stringify(v);
  if (Array.isArray(v)) return `[${v.map(write).join(",")}]`;
  const keys = Object.keys(v).sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  return `{${keys.map((k) => `${JSON.stringify(k)}:${write(v[k] as Json)}`).join(",")}}`;
}

/** The gate's digest of a call: 64 lowercase hex digits. */
export function digest(tool: string, args: unknown): string {
  return createHash("sha256").update(canonical({ tool, args: args === undefined ? null : args }), "utf8").digest("hex");
}
