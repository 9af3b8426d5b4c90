"""CrewAI through `estop.adapters.crewai`: a real `Crew`/`Agent` driven by a scripted
OpenAI-compatible model (tests/scenarios/crew_support.py), against the session's real gate.
CrewAI has its own venv (.venv-crewai, requirements-crewai.txt); elsewhere this module is skipped
with that reason."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("crewai", reason="CrewAI runs in its own venv: ./ci-install makes .venv-crewai (requirements-crewai.txt)")

from crewai.hooks.dispatch import InterceptionPoint, register_scoped  # noqa: E402
from crewai.tools import tool  # noqa: E402

import estop  # noqa: E402
from estop.adapters import crewai as ecr  # noqa: E402

from .scenarios.crew_support import ScriptedModel, call, crew  # noqa: E402
from .test_effect import wait_pending  # noqa: E402


def _tools(sent):
    @tool("wire_money")
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        sent.append(("wire", amount))
        return "wired"

    @tool("notify")
    def notify(to: str) -> str:
        """Tell someone."""
        sent.append(("email", to))
        return "sent"

    @tool("explode")
    def explode(to: str) -> str:
        """Fails."""
        sent.append(("explode", to))
        raise RuntimeError("card declined")

    return [wire_money, notify, explode]


def _tool_messages(model: ScriptedModel) -> dict[str, str]:
    """The tool results the model was shown, by call id (the last request has them all)."""
    return {m["tool_call_id"]: m["content"] for m in model.requests[-1]["messages"] if m.get("role") == "tool"}


@pytest.fixture
def model():
    made: list[ScriptedModel] = []

    def make(steps):
        made.append(ScriptedModel(steps))
        return made[-1]

    yield make
    for m in made:
        m.close()


async def test_crewai_hold_waits_for_the_operator_and_the_replay_reads_the_receipt(gate, daemon, run_id, model):
    """The transfer needs approval: the tool does not run until the operator approves in estop
    (the key is the model's call id); a redelivered job with the same call gets the recorded
    result, not a second transfer."""
    sent = []
    m1 = model([[call("wire_money", "w1", to="acct-9", amount=100)]])
    hooks = ecr.EstopHooks(approval={"wire_money"})
    job = asyncio.ensure_future(ecr.kickoff(crew(m1, _tools(sent)), gate=gate, run_id=run_id, hooks=hooks))
    p = await asyncio.to_thread(wait_pending, daemon.operator, run_id)
    assert sent == [] and p["key"] == estop.call_key(run_id, "wire_money", "w1", {"to": "acct-9", "amount": 100})
    await asyncio.to_thread(daemon.operator.approve, run_id, p["key"])
    await job
    assert sent == [("wire", 100)] and _tool_messages(m1) == {"w1": "wired"}

    m2 = model([[call("wire_money", "w1", to="acct-9", amount=100)]])
    await ecr.kickoff(crew(m2, _tools(sent)), gate=gate, run_id=run_id, hooks=hooks)
    assert sent == [("wire", 100)] and _tool_messages(m2) == {"w1": "wired"}


async def test_crewai_refusal_and_recorded_error_reach_the_model(gate, daemon, run_id, model):
    """A denied tool does not run and the model reads why; a tool that raised is recorded
    `error` and the same call again is not retried (CrewAI would run a tool whose hook raised:
    the hooks block instead)."""
    sent = []
    m1 = model([[call("notify", "d1", to="x")], [call("explode", "e1", to="y")]])
    await ecr.kickoff(crew(m1, _tools(sent)), gate=gate, run_id=run_id, hooks=ecr.EstopHooks(effects={"notify": "drop_table"}))
    got = _tool_messages(m1)
    assert sent == [("explode", "y")], sent
    assert "estop refused this call (denied)" in got["d1"] and "card declined" in got["e1"], got
    m2 = model([[call("explode", "e1", to="y")]])
    await ecr.kickoff(crew(m2, _tools(sent)), gate=gate, run_id=run_id)
    assert sent == [("explode", "y")] and "failed before" in _tool_messages(m2)["e1"]


async def test_crewai_whole_turn_is_admitted_before_any_call_starts(gate, daemon, run_id, model):
    """Another hook delays the transfer; without whole-turn admission the email was admitted,
    started and sent (CrewAI runs the turn's calls in a thread pool) before the transfer's
    approval existed. With it the email waits as the transfer's sibling until the operator
    decided."""
    sent, decided = [], []
    m = model([[call("notify", "n1", to="ops"), call("wire_money", "w1", to="acct-9", amount=100)]])

    def slow(ctx):
        if ctx.tool_name == "wire_money":
            time.sleep(0.3)  # validation, a lookup: it takes a while
        return None

    def operator():
        p = wait_pending(daemon.operator, run_id)
        time.sleep(0.2)
        decided.append(list(sent))
        daemon.operator.reject(run_id, p["key"])

    th = threading.Thread(target=operator, daemon=True)
    th.start()
    from crewai.hooks.dispatch import scoped_hooks

    with scoped_hooks():
        register_scoped(InterceptionPoint.PRE_TOOL_CALL, slow)
        await ecr.kickoff(crew(m, _tools(sent)), gate=gate, run_id=run_id, hooks=ecr.EstopHooks(approval={"wire_money"}))
    th.join()
    assert decided == [[]], "nothing of the turn ran while its approval was pending"
    assert sent == [("email", "ops")] and "rejected" in _tool_messages(m)["w1"]


async def test_crewai_interrupt_is_not_a_cancel(gate, daemon, run_id, model):
    """A timeout interrupts the kickoff: the tool's leftover thread is refused locally, and the
    next kickoff of the same run goes on."""
    sent, done = [], threading.Event()

    @estop.effect(tool="charge")
    def charge(amount: int) -> str:
        sent.append(("charge", amount))
        return "ok"

    @tool("refund")
    def refund(amount: int) -> str:
        """Refund slowly."""
        try:
            time.sleep(0.5)
            return charge(-amount)
        finally:
            done.set()

    m1 = model([[call("refund", "r1", amount=5)]])
    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        await ecr.kickoff(crew(m1, [refund]), gate=gate, run_id=run_id, timeout_s=0.2)
    await asyncio.to_thread(done.wait, 10)
    assert sent == []
    m2 = model([[call("refund", "r2", amount=6)]])
    await ecr.kickoff(crew(m2, [refund]), gate=gate, run_id=run_id)
    assert sent == [("charge", -6)]


async def test_crewai_operator_cancel_stops_the_crew(gate, daemon, run_id, model):
    """An operator's cancel while a tool works: kickoff_sync raises RunStopped, the tool's thread
    is refused, and the crew's next model call is blocked (the model is not asked again)."""
    sent, started, done = [], threading.Event(), threading.Event()

    @estop.effect(tool="charge")
    def charge(amount: int) -> str:
        sent.append(("charge", amount))
        return "ok"

    @tool("refund")
    def refund(amount: int) -> str:
        """Refund slowly."""
        started.set()
        try:
            time.sleep(0.5)
            return charge(-amount)
        finally:
            done.set()

    m = model([[call("refund", "r1", amount=5)], [call("refund", "r2", amount=6)]])
    raised: list[BaseException] = []

    def worker() -> None:  # kickoff_sync returns only when CrewAI's own thread is done
        try:
            ecr.kickoff_sync(crew(m, [refund]), gate=gate, run_id=run_id)
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    th = threading.Thread(target=worker)
    th.start()
    await asyncio.to_thread(started.wait, 10)
    await asyncio.to_thread(daemon.operator.cancel, run_id, "stop")
    await asyncio.to_thread(th.join, 30)
    assert done.is_set() and sent == [], sent
    assert len(raised) == 1 and isinstance(raised[0], estop.RunStopped), raised
    assert len(m.requests) == 1, "the model was asked again after the stop"


async def test_crewai_effects_in_a_tool_body_are_keyed_from_the_call(gate, daemon, run_id, model):
    """Two kickoffs of one run each bill the same amount, with different call ids: the
    `@estop.effect` inside the tool is keyed from its call, so both charges happen (keyed by its
    order in the kickoff, the second was read back as the first's receipt)."""
    charged = []

    @estop.effect(tool="charge")
    def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{len(charged)}"

    @tool("bill")
    def bill(amount: int) -> str:
        """Bill the customer."""
        return charge(amount)

    for cid in ("b1", "b2"):
        m = model([[call("bill", cid, amount=5)]])
        await ecr.kickoff(crew(m, [bill]), gate=gate, run_id=run_id)
        assert _tool_messages(m)[cid] == f"ch_{len(charged)}"
    assert charged == [5, 5]


async def test_crewai_hold_timeout_blocks_the_call_and_leaves_the_approval_pending(gate, daemon, run_id, model):
    """`hold_timeout_s` ends the wait in the hook: the transfer does not run, the model reads that
    an operator decides, and the approval is still pending in estop."""
    sent = []
    m = model([[call("wire_money", "w1", to="acct-9", amount=100)]])
    await ecr.kickoff(crew(m, _tools(sent)), gate=gate, run_id=run_id, hooks=ecr.EstopHooks(approval={"wire_money"}, hold_timeout_s=0.3))
    assert sent == [] and "held for an operator's decision" in _tool_messages(m)["w1"]
    assert [p["tool"] for p in daemon.operator.pending(run_id)] == ["wire_money"]


def _payout_flow(gate, wired):
    """A CrewAI Flow whose transfer is held by estop through CrewAI's own `@human_feedback`
    pause (a provider that raises `HumanFeedbackPending`; the flow's state is persisted)."""
    from crewai.flow import Flow, human_feedback, listen, start

    approval = ecr.FlowApproval(effect="wire_money", gate=gate)

    class Payout(Flow):
        @start()
        @human_feedback(message="Wire the refund?", provider=approval)
        def propose(self):
            return {"to": "acct-9", "amount": 100}

        @listen(propose)
        def pay(self):
            return approval.perform(self, lambda args: wired.append(args["amount"]) or "wired")

    return Payout


async def test_crewai_flow_hold_survives_a_restart_and_resumes_once(daemon, tmp_path):
    """Old: a hold waited inside the process (a restart lost it). Now a Flow's transfer is held
    through CrewAI's `@human_feedback` pause: the flow is persisted (`HumanFeedbackPending`), a
    new process (new gate client, new flow class) restores it with `from_pending`, waits for the
    operator's decision in estop and resumes; the transfer runs once, and the same pending state
    resumed again (a redelivered job) reads the receipt."""
    import shutil

    from crewai.flow import HumanFeedbackPending
    from crewai.flow.persistence.sqlite import SQLiteFlowPersistence

    wired = []
    db = tmp_path / "flows.db"
    gate1 = daemon.gate()
    out = await _payout_flow(gate1, wired)(persistence=SQLiteFlowPersistence(str(db))).kickoff_async()
    assert isinstance(out, HumanFeedbackPending) and wired == []
    held = out.context.metadata["estop"]
    run_id, flow_id = held["run"], out.context.flow_id
    p = await asyncio.to_thread(wait_pending, daemon.operator, run_id)
    assert p["key"] == held["key"] and p["tool"] == "wire_money"
    gate1.close()
    shutil.copy(db, tmp_path / "redelivered.db")

    gate2 = daemon.gate()  # a new process: the operator decides while it waits
    flow = _payout_flow(gate2, wired).from_pending(flow_id, SQLiteFlowPersistence(str(db)))
    threading.Timer(0.2, daemon.operator.approve, args=(run_id, p["key"])).start()
    assert await ecr.resume_flow(flow, gate=gate2, timeout_s=10) == "wired"
    assert wired == [100]
    again = _payout_flow(gate2, wired).from_pending(flow_id, SQLiteFlowPersistence(str(tmp_path / "redelivered.db")))
    assert await ecr.resume_flow(again, gate=gate2, timeout_s=10) == "wired"
    assert wired == [100], "the redelivered resume read the receipt"
    gate2.close()


async def test_crewai_flow_feedback_written_by_the_agent_decides_nothing(gate, daemon, tmp_path):
    """The application resumes the pending flow with its own "approve": the transfer still asks
    the gate, which holds it (the operator has not decided): `HeldForApproval`, nothing runs.
    After the operator's reject the same pending state (saved before) is refused."""
    import shutil

    from crewai.flow import HumanFeedbackPending
    from crewai.flow.persistence.sqlite import SQLiteFlowPersistence

    wired = []
    db = tmp_path / "flows.db"
    out = await _payout_flow(gate, wired)(persistence=SQLiteFlowPersistence(str(db))).kickoff_async()
    assert isinstance(out, HumanFeedbackPending)
    held = out.context.metadata["estop"]
    shutil.copy(db, tmp_path / "saved.db")
    forged = _payout_flow(gate, wired).from_pending(out.context.flow_id, SQLiteFlowPersistence(str(db)))
    with pytest.raises(estop.HeldForApproval):
        await forged.resume_async("approve")
    assert wired == [] and [p["key"] for p in daemon.operator.pending(held["run"])] == [held["key"]]
    await asyncio.to_thread(daemon.operator.reject, held["run"], held["key"])
    flow = _payout_flow(gate, wired).from_pending(out.context.flow_id, SQLiteFlowPersistence(str(tmp_path / "saved.db")))
    with pytest.raises(estop.Rejected):
        await ecr.resume_flow(flow, gate=gate, timeout_s=10)
    assert wired == []


def _billing(charged):
    """`bill` (a gated tool) whose body charges through an `@estop.effect`."""

    @estop.effect(tool="charge")
    def charge(amount: int) -> str:
        charged.append(amount)
        return f"ch_{len(charged)}"

    @tool("bill")
    def bill(amount: int) -> str:
        """Bill the customer."""
        return charge(amount)

    return bill


def _retrying(m, tools):
    c = crew(m, tools)
    c.agents[0].max_retry_limit = 2
    return c


async def test_crewai_task_retry_reuses_the_failed_attempts_keys(gate, daemon, run_id, model):
    """CrewAI runs a failed task again (`max_retry_limit`) and the model asks afresh, with new
    call ids: the retry's call of the same tool with the same arguments is keyed as the failed
    attempt's (its body's `@estop.effect` too), so it reads the receipt instead of charging again;
    a second failure chains (the third attempt reads the same receipt)."""
    charged = []
    m = model([[call("bill", "b1", amount=5)], 400, [call("bill", "b2", amount=5)], 400, [call("bill", "b3", amount=5)]])
    await ecr.kickoff(_retrying(m, [_billing(charged)]), gate=gate, run_id=run_id)
    assert charged == [5], "the retried task charged again"
    assert _tool_messages(m) == {"b3": "ch_1"}
    done = {e["key"] for e in daemon.operator.report(run_id)["done"]}
    assert done == {estop.call_key(run_id, "bill", "b1", {"amount": 5}), estop.derive_key(run_id, "call:b1", "charge", estop.digest("charge", {"amount": 5}), 1)}, done


async def test_crewai_task_retry_waits_for_a_late_failure_report(gate, daemon, run_id, model, monkeypatch):
    """CrewAI runs event handlers in a thread pool and does not wait for them: the report that the
    attempt failed can come after the retry has begun. Here it comes 1.5 s late (a busy pool); the
    retry's first model call waits for CrewAI's handlers, so its charge still reads the receipt."""
    slow = ecr._note_report

    def late(event):
        time.sleep(1.5)
        slow(event)

    monkeypatch.setattr(ecr, "_note_report", late)
    charged = []
    m = model([[call("bill", "b1", amount=5)], 400, [call("bill", "b2", amount=5)]])
    await ecr.kickoff(_retrying(m, [_billing(charged)]), gate=gate, run_id=run_id)
    assert charged == [5], "the retry was keyed before the failed attempt's report came"


async def test_crewai_task_retry_links_text_mode_calls(gate, daemon, run_id, model):
    """A model without function calling: CrewAI's text-mode (ReAct) calls carry no id and are
    keyed by their order in the invocation, so the retry's call was the second occurrence, a new
    key. It is keyed as the failed attempt's call instead, and reads its receipt."""
    charged = []
    react = 'Thought: bill it\nAction: bill\nAction Input: {"amount": 5}'
    m = model([react, 400, react, "Thought: billed\nFinal Answer: done"])
    c = _retrying(m, [_billing(charged)])
    object.__setattr__(c.agents[0].llm, "supports_function_calling", lambda: False)
    await ecr.kickoff(c, gate=gate, run_id=run_id)
    assert charged == [5], "the retried text-mode call charged again"
    assert len(daemon.operator.report(run_id)["done"]) == 2  # the tool call and the charge in it


async def test_crewai_task_retry_past_the_attempts_bound_is_not_linked(gate, daemon, run_id, model, monkeypatch, caplog):
    """Attempts followed per task are bounded (`_ATTEMPTS_MAX`): past it, the retry's calls are
    keyed as their own (the charge runs again) and the log says so."""
    monkeypatch.setattr(ecr, "_ATTEMPTS_MAX", 1)
    charged = []
    m = model([[call("bill", "b1", amount=5)], 400, [call("bill", "b2", amount=5)]])
    with caplog.at_level("WARNING", logger="estop.adapters.crewai"):
        await ecr.kickoff(_retrying(m, [_billing(charged)]), gate=gate, run_id=run_id)
    assert charged == [5, 5]
    assert any("more than 1 attempts" in r.getMessage() for r in caplog.records), caplog.records


async def test_crewai_task_retry_with_other_arguments_is_a_new_effect(gate, daemon, run_id, model):
    """A wrong match is worse than the leak: in the retried task, a call of the same tool with
    other arguments, and a second identical call beyond what the failed attempt made, are new
    effects (they run); only the failed attempt's own call is read back."""
    charged = []
    m = model([[call("bill", "b1", amount=5)], 400, [call("bill", "b2", amount=5), call("bill", "b3", amount=7)], [call("bill", "b4", amount=5)]])
    await ecr.kickoff(_retrying(m, [_billing(charged)]), gate=gate, run_id=run_id)
    assert sorted(charged) == [5, 5, 7], charged
    tm = _tool_messages(m)
    assert tm["b2"] == "ch_1" and tm["b3"] != "ch_1" and tm["b4"] not in ("ch_1", tm["b3"]), tm


async def test_crewai_task_retry_of_another_task_or_agent_is_not_linked(gate, daemon, run_id, model):
    """Two tasks of one crew making the same call are two effects, whatever failed in between:
    the second task's first attempt is not a retry of the first task (it fails once, is retried,
    and its retry is linked to its own failed attempt only)."""
    from crewai import Crew, Task

    charged = []
    m = model([[call("bill", "b1", amount=5)], [], [call("bill", "b2", amount=5)], 400, [call("bill", "b3", amount=5)]])
    c = _retrying(m, [_billing(charged)])
    agent = c.agents[0]
    two = Crew(agents=[agent], tasks=[Task(description="First.", expected_output="done", agent=agent), Task(description="Second.", expected_output="done", agent=agent)], cache=False, verbose=False)
    await ecr.kickoff(two, gate=gate, run_id=run_id)
    assert charged == [5, 5], charged


def test_crewai_same_crew_kicked_off_twice_in_one_run_is_not_a_retry(gate, daemon, run_id, model):
    """`hooks.install()` and one `gate.run(...)` around two kickoffs of one crew object (same agent,
    same task): the second execution of the task followed a completed one, not a failed one, so
    its identical call (a new call id) is a new effect. CrewAI's report of the completion is read
    before the second execution's first model call, so this takes no waiting."""
    charged = []
    m = model([[call("bill", "b1", amount=5)], [], [call("bill", "b2", amount=5)], []])
    c = _retrying(m, [_billing(charged)])
    hooks = ecr.EstopHooks().install()
    try:
        with gate.run(run_id):
            c.kickoff()
            t0 = time.monotonic()
            c.kickoff()
            took = time.monotonic() - t0
    finally:
        hooks.uninstall()
    assert charged == [5, 5], charged
    assert took < 5, took
