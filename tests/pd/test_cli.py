"""`kvhal proxy`'s command line: bad backend specs are usage errors naming the value."""
from __future__ import annotations

import pytest

from kvhal.cli import build_parser
from kvhal.integrations.pd.backends import P2PAddress


@pytest.mark.parametrize("spec, message", [
    ("http://a:1", "--prefiller must be URL,P2P_HOST:P2P_PORT[,DP_SIZE], got 'http://a:1'"),
    ("http://a:1,h:0", "p2p address must be HOST:PORT with PORT in 1..65535, got 'h:0'"),
    ("ftp://a:1,h:5", "backend URL must be http(s)://host:port, got 'ftp://a:1'"),
    ("http://a:1/v1,h:5", "must not have a path or query"),
    ("http://a:1,h:5,0", "DP_SIZE must be an integer >= 1, got '0'")],
    ids=["no-p2p", "port-0", "scheme", "path", "dp-0"])
def test_bad_prefiller_specs_are_usage_errors(capsys, spec, message):
    """Fails when a malformed --prefiller is accepted or its error hides the value."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["proxy", "--prefiller", spec, "--decoder", "http://d:2"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_prefiller_spec_names_its_p2p_address_and_dp_size():
    """Fails when the spec's parts land in the wrong fields (e.g. IPv6 brackets kept)."""
    args = build_parser().parse_args(["proxy", "--prefiller", "http://p:8100/,[::1]:7100,4",
                                      "--decoder", "https://d:8200"])
    (p,), (d,) = args.prefiller, args.decoder
    assert (p.url, p.p2p, p.dp_size) == ("http://p:8100", P2PAddress("::1", 7100), 4)
    assert (d.url, d.p2p, args.order) == ("https://d:8200", None, "prefill-first")


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_first_byte_timeout_must_be_positive_seconds(capsys, value):
    """Fails when a zero, negative or non-numeric --first-byte-timeout-s is accepted."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["proxy", "--route", "kv", "--instance", "http://a:1",
                                   "--first-byte-timeout-s", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--first-byte-timeout-s" in err and repr(value) in err


def test_the_first_byte_timeout_defaults_to_120_s():
    args = build_parser().parse_args(["proxy", "--route", "kv", "--instance", "http://a:1"])
    assert args.first_byte_timeout_s == 120.0
