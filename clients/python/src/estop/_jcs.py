"""RFC 8785 (JCS) canonical JSON and the effect digest, byte-for-byte what the gate computes.

digest = hex(SHA-256(JCS({"tool": tool, "args": args})))  (docs/PROTOCOL.md, "The effect digest")
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

__all__ = ["canonical", "digest", "to_json_value"]


def _number(x: float) -> str:
    """ECMAScript Number.prototype.toString of a double (RFC 8785 §3.2.2.3)."""
    if math.isnan(x) or math.isinf(x):
        raise ValueError("JCS cannot encode NaN or Infinity")
    if x == 0:
        return "0"  # -0 too
    sign = "-" if x < 0 else ""
    # repr() is the shortest round-tripping decimal, exactly the digits ECMAScript picks.
    r = repr(abs(x))
    if "e" in r:
        mant, exp_s = r.split("e")
        exp = int(exp_s)
    else:
        mant, exp = r, 0
    if "." in mant:
        int_part, frac = mant.split(".")
    else:
        int_part, frac = mant, ""
    if frac == "0":
        frac = ""
    digits = (int_part + frac).lstrip("0")
    # value = 0.DIGITS × 10^n
    n = len(int_part) + exp if int_part != "0" else exp - (len(frac) - len(frac.lstrip("0")))
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    m = digits[0] + ("." + digits[1:] if k > 1 else "")
    return sign + m + "e" + ("+" if e >= 0 else "-") + str(abs(e))


def to_json_value(value: Any) -> Any:
    """Turns common Python objects (pydantic models, dataclasses, tuples, sets of str) into JSON values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"JSON object keys must be strings, got {type(k).__name__}")
            out[k] = to_json_value(v)
        return out
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic v2
        return to_json_value(dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json_value(dataclasses.asdict(value))
    raise TypeError(f"cannot encode {type(value).__name__} as JSON for an effect digest")


def _write(v: Any, out: list[str]) -> None:
    if v is None:
        out.append("null")
    elif v is True:
        out.append("true")
    elif v is False:
        out.append("false")
    elif isinstance(v, int):
        out.append(_number(float(v)))  # the gate reads every number as a double
    elif isinstance(v, float):
        out.append(_number(v))
    elif isinstance(v, str):
        out.append(json.dumps(v, ensure_ascii=False))
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, item in enumerate(v):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    elif isinstance(v, dict):
        out.append("{")
        for i, k in enumerate(sorted(v, key=lambda s: s.encode("utf-16-be"))):
            if i:
                out.append(",")
            out.append(json.dumps(k, ensure_ascii=False))
            out.append(":")
            _write(v[k], out)
        out.append("}")
    else:
        _write(to_json_value(v), out)


def canonical(value: Any) -> str:
    """The RFC 8785 canonical JSON text of `value`."""
    out: list[str] = []
    _write(value, out)
    return "".join(out)


def digest(tool: str, args: Any) -> str:
    """The gate's effect digest: hex SHA-256 of JCS({"tool": tool, "args": args})."""
    text = canonical({"tool": tool, "args": args})
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
