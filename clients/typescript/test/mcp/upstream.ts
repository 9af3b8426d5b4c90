// An upstream MCP server on the official TypeScript SDK (McpServer over stdio), for mcp.test.ts:
// it appends one line to $FIXTURE_LOG for every call it receives, so a test can read what
// reached it. Tools: `add {a, b}` (read-only), `pay {amount}` (destructive).
import { appendFileSync } from "node:fs";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StdioServerTransport } from "@modelcontextprotocol/sdk/server/stdio.js";
import { z } from "zod";

function log(line: string): void {
  const path = process.env.FIXTURE_LOG;
  if (path) appendFileSync(path, `${line}\n`);
}

const server = new McpServer({ name: "ts-upstream", version: "1.0.0" });
server.registerTool(
  "add",
  { description: "Adds two numbers.", inputSchema: { a: z.number(), b: z.number() }, annotations: { readOnlyHint: true } },
  async ({ a, b }) => {
    log(`call add ${a} ${b}`);
    return { content: [{ type: "text", text: String(a + b) }] };
  },
);
server.registerTool(
  "pay",
  { description: "Pays an amount.", inputSchema: { amount: z.number() }, annotations: { destructiveHint: true } },
  async ({ amount }) => {
    log(`call pay ${amount}`);
    return { content: [{ type: "text", text: `paid ${amount}` }] };
  },
);
await server.connect(new StdioServerTransport());
