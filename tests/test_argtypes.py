"""`kvhal.argtypes`: the arg types CLI verbs share (bench serve/fleet, kvhal proxy)."""
from __future__ import annotations

import argparse

import pytest

from kvhal.argtypes import listen_port, names_from, positive_seconds


def test_listen_port_takes_0_to_65535_and_names_a_bad_value():
    """Fails when 0 (any free port) or 65535 is refused, or 65536 / a non-number passes."""
    assert [listen_port(t) for t in ("0", "8000", "65535")] == [0, 8000, 65535]
    for bad in ("65536", "-1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            listen_port(bad)


def test_positive_seconds_refuses_zero_negative_and_non_finite():
    """Fails when 0, a negative, NaN or infinity passes as a duration."""
    assert positive_seconds("0.5") == 0.5
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            positive_seconds(bad)


def test_names_from_keeps_the_known_order_and_lists_the_known_names_on_error():
    """Fails when the list comes back in the user's order or with duplicates, or an unknown
    or empty list passes."""
    parse = names_from(("a", "b", "c"), "thing")
    assert parse(" c, a,c ") == ["a", "c"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown thing\(s\) \['d'\]; "
                                                          r"known: a, b, c"):
        parse("a,d")
    with pytest.raises(argparse.ArgumentTypeError, match="known: a, b, c"):
        parse(" , ")
