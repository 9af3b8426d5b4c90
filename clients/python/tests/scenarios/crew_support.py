"""A scripted model for CrewAI tests (no network beyond loopback): CrewAI talks to models through
OpenAI-compatible clients, so the model is a local OpenAI-compatible chat completions server
whose answers are scripted. Answer i is steps[i] (a list of tool calls, a str: that text, or an
int: an HTTP error status), then "done"; `on_user` answers the first request whose latest user message contains a
given text, once."""

from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# CrewAI phones home (telemetry, traces) unless told not to; the tests talk to loopback only.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_DISABLE_TRACKING", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai import LLM, Agent, Crew, Task  # noqa: E402

# The scripted model has no tokenizer: CrewAI warns on every call that it estimates tokens.
logging.getLogger("crewai.llms.base_llm").setLevel(logging.ERROR)


def call(name: str, call_id: str, **args: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


class ScriptedModel:
    """The OpenAI-compatible server; `requests` keeps every request body it answered."""

    def __init__(self, steps: list[Any], on_user: dict[str, list[Any]] | None = None) -> None:
        self.steps = list(steps)
        self.on_user = dict(on_user or {})
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        model = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = model._answer(body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _next(self, body: dict[str, Any]) -> Any:
        with self._lock:
            self.requests.append(body)
            said = [m.get("content") or "" for m in body.get("messages", []) if m.get("role") == "user"]
            for text in list(self.on_user):
                if said and text in str(said[-1]):
                    return self.on_user.pop(text)
            # A model answers what it was asked: after tool results it continues the script.
            return self.steps.pop(0) if self.steps else None

    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        step = self._next(body)
        if isinstance(step, int):
            return step, {"error": {"message": "scripted failure", "type": "invalid_request_error", "code": str(step)}}
        if isinstance(step, str):  # a text answer (a text-mode ReAct step)
            msg, finish = {"role": "assistant", "content": step}, "stop"
        elif step:
            msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": step}
            finish = "tool_calls"
        else:
            msg, finish = {"role": "assistant", "content": "done"}, "stop"
        return 200, {
            "id": f"cmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "scripted"),
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def crew(model: ScriptedModel, tools: list[Any], *, task: str = "Do the job.", **agent_kw: Any) -> Crew:
    """One agent, one task, the scripted model; CrewAI's tool cache off (a cached result would
    hide a second call from the world)."""
    llm = LLM(model="openai/scripted", base_url=model.url, api_key="sk-scripted", max_retries=0)
    agent = Agent(role="ops", goal="Operate", backstory="Scripted.", llm=llm, tools=tools, cache=False, max_iter=6, max_retry_limit=0, verbose=False, **agent_kw)
    return Crew(agents=[agent], tasks=[Task(description=task, expected_output="done", agent=agent)], cache=False, verbose=False)
