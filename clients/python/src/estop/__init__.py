"""estop: make "stop" mean stop for AI agents — the Python client and framework adapters.

Every side effect is admitted by the estop gate first (docs/PROTOCOL.md). Start here:

    import estop
    gate = estop.Estop()                        # ESTOP_SOCKET / ESTOP_ADDR / ESTOP_TOKEN

    @estop.effect(tool="refund")
    def refund(charge: str, amount: int) -> dict: ...

    with gate.run("order-42"):
        refund("ch_1", 10)                      # admitted, held for approval, or refused
"""

from ._jcs import canonical, digest
from .aio import AsyncClient
from .client import Client
from .compensation import CompensationUnknown, CompensationWorker
from .config import Config
from .effect import EffectCall, call_args, call_key, effect, gate_async, gate_sync, make_call, run_async, run_sync
from .errors import (
    BadToken,
    ConnectionLost,
    Conflict,
    Denied,
    EffectFailed,
    EstopError,
    EstopTimeout,
    Forbidden,
    GateError,
    HeldForApproval,
    InDoubt,
    Interrupted,
    InvalidRequest,
    LimitExceeded,
    LineTooLong,
    Mismatch,
    NoRun,
    NotFound,
    NotPending,
    Refused,
    Rejected,
    RunStopped,
    Unauthenticated,
    Unavailable,
)
from .keys import derive_key
from .run import Estop, Invocation, Run, Step, configure, current_invocation, current_run, current_step, default, step
from .verdicts import Admitted, Duplicate, Go, Held, RefusedVerdict, Verdict

__version__ = "0.1.0"

__all__ = [
    "Admitted", "AsyncClient", "BadToken", "Client", "CompensationUnknown", "CompensationWorker", "Config", "Conflict", "ConnectionLost",
    "Denied", "Duplicate", "EffectCall", "EffectFailed", "Estop", "EstopError", "EstopTimeout",
    "Forbidden", "GateError", "Go", "Held", "HeldForApproval", "InDoubt", "Interrupted", "InvalidRequest",
    "LimitExceeded", "LineTooLong", "Mismatch", "NoRun", "NotFound", "NotPending", "Refused", "RefusedVerdict",
    "Invocation", "Rejected", "Run", "RunStopped", "Step", "Unauthenticated", "Unavailable", "Verdict",
    "call_args", "call_key", "canonical", "configure", "current_invocation", "current_run", "current_step", "default", "derive_key",
    "digest", "effect", "gate_async", "gate_sync", "make_call", "run_async", "run_sync", "step",
]
