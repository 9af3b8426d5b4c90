"""Listings come in pages (docs/PROTOCOL.md, "Pages"): the clients follow the cursor, so
`runs()`, `pending()` and `report()` return everything however small the gate's pages are."""

from __future__ import annotations

import pytest

import estop
from estop.testing import Daemon

from .conftest import POLICY


@pytest.fixture(scope="module")
def paged():
    d = Daemon(policy=POLICY, args=("--page-bytes-max", "600"))
    d.start()
    c = d.client()
    for i in range(7):
        assert isinstance(c.admit(f"held-{i}", "k", "wire_money", {"amount": i}), estop.Held)
    for i in range(6):
        c.admit("many", f"k{i}", "send", {"i": i})
    c.close()
    yield d
    d.cleanup()


def test_sync_client_reads_every_page(paged):
    op = paged.operator
    page = op.call("pending")
    assert page["more"] is True and len(page["pending"]) < 7, "the gate really pages"
    assert sorted(p["run"] for p in op.pending()) == [f"held-{i}" for i in range(7)]
    assert [r["run"] for r in op.runs()] == sorted([f"held-{i}" for i in range(7)] + ["many"])
    assert len(op.runs(limit=3)) == 3
    report = op.report("many")
    assert [i["key"] for i in report["in_flight"]] == [f"k{i}" for i in range(6)]
    assert "next" not in report and "more" not in report


async def test_async_client_reads_every_page(paged):
    async with estop.AsyncClient(socket=paged.socket, token=paged.operator_token) as c:
        assert len(await c.pending()) == 7
        assert len(await c.runs()) == 8
        assert len((await c.report("many"))["in_flight"]) == 6
