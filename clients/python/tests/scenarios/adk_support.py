"""A scripted model and a runner for Google ADK tests (no network): the model answers call i
with steps[i] (a list of parts, or an exception to raise), then "done"."""

from __future__ import annotations

from typing import Any, AsyncGenerator

from google.adk.agents import LlmAgent
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions import InMemorySessionService
from google.genai import types


class ScriptedLlm(BaseLlm):
    steps: list[Any] = []
    #: Or: the answer to the latest user text, once (the model reacts to what the user said).
    on_user: dict[str, list[Any]] = {}

    async def generate_content_async(self, llm_request: Any, stream: bool = False) -> AsyncGenerator[LlmResponse, None]:
        said = [p.text for c in llm_request.contents if c.role == "user" for p in c.parts or [] if p.text]
        if said and said[-1] in self.on_user:
            step = self.on_user.pop(said[-1])
        else:
            step = self.steps.pop(0) if self.steps else [types.Part(text="done")]
        if isinstance(step, BaseException):
            raise step
        yield LlmResponse(content=types.Content(role="model", parts=step))


def call(name: str, call_id: str, **args: Any) -> types.Part:
    return types.Part(function_call=types.FunctionCall(name=name, args=args, id=call_id))


def user(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


def runner(steps: list[Any], tools: list[Any], plugins: list[Any], sessions: Any = None, on_user: dict[str, list[Any]] | None = None, llm: type[ScriptedLlm] = ScriptedLlm) -> Runner:
    agent = LlmAgent(name="ops", model=llm(model="scripted", steps=list(steps), on_user=dict(on_user or {})), tools=tools)
    return Runner(app_name="ops", agent=agent, session_service=sessions or InMemorySessionService(), plugins=plugins)


def texts(events: list[Any]) -> list[str]:
    return [p.text for ev in events if ev.content for p in ev.content.parts or [] if p.text]


def tool_results(events: list[Any]) -> dict[str, Any]:
    return {p.function_response.id: p.function_response.response for ev in events if ev.content for p in ev.content.parts or [] if p.function_response}
