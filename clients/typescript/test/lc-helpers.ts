// A scripted chat model for the LangChain-based tests: a real BaseChatModel whose n-th call
// answers the n-th scripted message (or a function of the conversation).
import { BaseChatModel } from "@langchain/core/language_models/chat_models";
import { AIMessage, type BaseMessage } from "@langchain/core/messages";
import type { ChatResult } from "@langchain/core/outputs";

export class ScriptedChatModel extends BaseChatModel {
  private turn = 0;
  constructor(private readonly script: Array<AIMessage | ((m: BaseMessage[]) => AIMessage)>) {
    super({});
  }
  _llmType(): string {
    return "scripted";
  }
  async _generate(messages: BaseMessage[]): Promise<ChatResult> {
    const step = this.script[Math.min(this.turn++, this.script.length - 1)];
    const message = typeof step === "function" ? step(messages) : (step ?? new AIMessage("done"));
    return { generations: [{ text: typeof message.content === "string" ? message.content : "", message }] };
  }
}

