"""Stable idempotency keys: run + logical step + tool + the call's digest (+ occurrence).

The same call at the same logical step of the same run gets the same key on replay and resume
(so the gate answers `duplicate` with the recorded result); a genuinely new call (other arguments,
another step, or the n-th identical call within one step) gets a new key.
"""

from __future__ import annotations

import hashlib

from ._jcs import canonical

__all__ = ["derive_key"]

_STEP_BYTES_MAX = 80
_TOOL_BYTES_MAX = 60


def _clip(text: str, limit: int) -> str:
    clean = "".join(c if c.isprintable() else "?" for c in text)
    b = clean.encode("utf-8")[:limit]
    return b.decode("utf-8", errors="ignore")


def derive_key(run: str, step: str, tool: str, digest: str, occurrence: int = 1) -> str:
    """A key of at most ~170 bytes: readable prefix, then a hash binding every part."""
    h = hashlib.sha256(canonical([run, step, tool, digest, occurrence]).encode("utf-8")).hexdigest()[:24]
    return f"{_clip(step, _STEP_BYTES_MAX)}:{_clip(tool, _TOOL_BYTES_MAX)}:{occurrence}:{h}"
