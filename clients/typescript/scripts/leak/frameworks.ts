// The adapters the leak table measures, by the name `--framework` takes.
import type { Scenarios } from "./common.js";
import { scenarios as ai } from "./ai.js";
import { scenarios as langgraph } from "./langgraph.js";
import { scenarios as openaiAgents } from "./openai-agents.js";

export const FRAMEWORKS: Record<string, { label: string; scenarios: Scenarios }> = {
  langgraph: { label: "LangGraph.js", scenarios: langgraph },
  ai: { label: "Vercel AI SDK", scenarios: ai },
  "openai-agents": { label: "OpenAI Agents JS", scenarios: openaiAgents },
};
