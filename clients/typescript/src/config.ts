// Where the gate is and how to authenticate: explicit options, else the environment
// (ESTOP_SOCKET or ESTOP_ADDR, ESTOP_TOKEN or ESTOP_TOKEN_FILE, ESTOP_DATA for both, ESTOP_RUN).
import { readFileSync } from "node:fs";
import { join } from "node:path";

export interface Endpoint {
  /** Path of the gate's Unix socket (`DATA/estop.sock`). */
  socket?: string | undefined;
  /** `host:port` of the gate's TCP listener. */
  addr?: string | undefined;
  /** The token for `hello` (agent, operator or observer). */
  token?: string | undefined;
}

export interface Config {
  socket?: string | undefined;
  host?: string | undefined;
  port?: number | undefined;
  token?: string | undefined;
  run?: string | undefined;
}

export function parseAddr(addr: string): { host: string; port: number } {
  const i = addr.lastIndexOf(":");
  const port = Number(addr.slice(i + 1));
  if (i <= 0 || !Number.isInteger(port) || port < 1 || port > 65535) {
    throw new TypeError(`gate address ${JSON.stringify(addr)} is not host:port`);
  }
  return { host: addr.slice(0, i).replace(/^\[(.*)\]$/, "$1"), port };
}

/** Options first, then the environment. ESTOP_DATA supplies the socket and the agent token. */
export function resolveConfig(opts: Endpoint = {}, env: NodeJS.ProcessEnv = process.env): Config {
  const data = env.ESTOP_DATA;
  let socket = opts.socket;
  let addr = opts.addr;
  if (socket === undefined && addr === undefined) {
    socket = env.ESTOP_SOCKET || undefined;
    addr = socket ? undefined : env.ESTOP_ADDR || undefined;
    if (!socket && !addr && data) socket = join(data, "estop.sock");
  }
  let token = opts.token ?? (env.ESTOP_TOKEN || undefined);
  if (token === undefined && env.ESTOP_TOKEN_FILE) token = readFileSync(env.ESTOP_TOKEN_FILE, "utf8").trim();
  if (token === undefined && data) {
    try {
      token = readFileSync(join(data, "agent.token"), "utf8").trim();
    } catch {
      // no readable agent token there: hello will say so
    }
  }
  const out: Config = { token, run: env.ESTOP_RUN || undefined };
  if (socket) out.socket = socket;
  else if (addr) Object.assign(out, parseAddr(addr));
  return out;
}
