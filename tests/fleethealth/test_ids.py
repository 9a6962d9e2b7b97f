"""Deterministic ids: pinned values (an id format change would re-key stored history), and the same
record always gets the same id while any identifying field changes it."""

from __future__ import annotations

import hashlib

from fleethealth.ids import derived, digest, token
from fleethealth.schema import Action, Finding, FindingKind, Recommendation


def test_ids_are_pinned():
    assert digest("straggler", None, 1.5, 7) == "c721cd1e75831871394653d3"
    f = Finding(kind=FindingKind.XID, node="n0019", ts=1767226240.0, gpu=6, detector="health.xid")
    assert f.id == "c0138a12a6eef479540b1eee"
    rec = Recommendation(action=Action.DRAIN, node="n0019", ts=1767226240.0, reason="x", finding_id=f.id)
    assert rec.id == "d136183eeab86985f51cc3ad"


def test_an_id_names_what_it_is_about():
    assert digest("a", 1) == digest("a", 1) != digest("a", 2)
    assert digest("ab", "c") != digest("a", "bc")  # fields are separated, not concatenated
    assert derived("breaker", "abc") == "breaker:abc"


def test_token_is_blake2b_over_the_chunks_in_order():
    assert token(["x;", "y"]) == hashlib.blake2b(b"x;y", digest_size=12).hexdigest()
    assert token(["x;", "y"]) != token(["y", "x;"])
