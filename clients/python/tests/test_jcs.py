import math

import pytest

from estop import canonical, digest


def test_protocol_vector():
    assert canonical({"tool": "refund", "args": {"amount": 10.0, "to": "acct-1"}}) == '{"args":{"amount":10,"to":"acct-1"},"tool":"refund"}'
    assert digest("refund", {"amount": 10.0, "to": "acct-1"}) == "8833f3bd12786d1bfb0512eb3624a0de38e845d906c110a4bab60af53bbd1b96"


@pytest.mark.parametrize(
    "value,text",
    [
        (0.0, "0"), (-0.0, "0"), (1.0, "1"), (1e21, "1e+21"), (1e20, "100000000000000000000"),
        (1e-7, "1e-7"), (0.000001, "0.000001"), (123.456, "123.456"), (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"), (2**53 + 1, "9007199254740992"),
        (-1.5, "-1.5"), (333333333.3333333, "333333333.3333333"), (4.5e-5, "0.000045"),
    ],
)
def test_numbers(value, text):
    assert canonical(value) == text


def test_strings_and_keys():
    assert canonical("a\u0001\n\"\\/é€") == '"a\\u0001\\n\\"\\\\/é€"'
    # keys sort by UTF-16 code units: U+1F600 (surrogates D83D..) sorts before U+FF5E
    assert canonical({"\uff5e": 1, "\U0001F600": 2, "a": 3}) == '{"a":3,"\U0001F600":2,"\uff5e":1}'
    assert canonical([True, False, None, {}]) == "[true,false,null,{}]"


def test_rejects_non_finite():
    with pytest.raises(ValueError):
        canonical(math.nan)


def test_matches_gate(daemon, run_id):
    """The gate computes the same digest: a digest-only admit of the same call is a duplicate,
    an admit with other args under the same key is a mismatch."""
    c = daemon.client()
    args = {"amount": 1e21, "when": 0.1, "s": "\u2028é\x7f", "nested": {"b": [1, 2.50], "a": None}}
    v = c.admit(run_id, "k1", "noop", args)
    assert v.__class__.__name__ == "Admitted"
    c.complete(run_id, "k1", v.token, "ok")
    dup = c.admit(run_id, "k1", "noop", digest=digest("noop", args))
    assert dup.__class__.__name__ == "Duplicate", dup
    mis = c.admit(run_id, "k1", "noop", digest=digest("noop", {"amount": 1}))
    assert getattr(mis, "reason", None) == "mismatch"
    c.close()
