"""p2p tier config validation: each bad value is a TierError naming its key; the auth key
never shows in an error, a repr or the config loader's messages."""
from __future__ import annotations

import pytest

from kvhal.config import ConfigError, parse_config as parse_engine_config
from kvhal.engine import build_manager
from kvhal.host import host_geometry
from kvhal.tier import TierError
from kvhal.tiers.p2p import P2PTier, parse_config

from .helpers import NAMESPACE, host_region

SECRET = "s3cret-s3cret-s3cret"
OK = {"auth_key": SECRET}
BAD = [
    ({}, "auth_key: exactly one of auth_key and auth_key_file is required"),
    ({"auth_key": SECRET, "auth_key_file": "/k"}, "auth_key: exactly one of"),
    ({"auth_key": "short"}, "auth_key: the key must be at least 16 characters (value not shown)"),
    ({"auth_key": 12345678901234567890}, "auth_key: must be a string (value not shown), got a int"),
    (OK | {"host": "0.0.0.0"}, "host: '0.0.0.0' is not a routable identity for peers"),
    (OK | {"host": "::"}, "host: '::' is not a routable identity for peers"),
    (OK | {"host": "0.0.0.0", "advertise_host": "0.0.0.0"}, "advertise_host: '0.0.0.0' is not"),
    (OK | {"host": ""}, "host: must be a host name or IP address, got ''"),
    (OK | {"port": 70000}, "port: must be an integer in 0..65535 (0 = ephemeral), got 70000"),
    (OK | {"port": "80"}, "port: must be an integer in 0..65535 (0 = ephemeral), got '80'"),
    (OK | {"peers": "a:1"}, "peers: must be a list of \"host:port\" strings, got str"),
    (OK | {"peers": ["a:1", "b"]}, "peers[1]: must be \"host:port\", got 'b'"),
    (OK | {"peers": ["a:0"]}, "peers[0]: port must be in 1..65535, got 'a:0'"),
    (OK | {"peers": ["0.0.0.0:5"]}, "peers[0]: 0.0.0.0 is not a routable peer address"),
    (OK | {"num_threads": 0}, "num_threads: must be a positive integer, got 0"),
    (OK | {"max_inflight": True}, "max_inflight: must be a positive integer, got True"),
    (OK | {"max_bytes": -1}, "max_bytes: must be a positive integer, got -1"),
    (OK | {"timeout_s": 0}, "timeout_s: must be a number of seconds in (0, 600.0], got 0"),
    (OK | {"timeout_s": float("nan")}, "timeout_s: must be a number of seconds in (0, 600.0]"),
    (OK | {"timeout": 1}, "timeout: unknown key for the p2p tier; accepted: advertise_host, "
                          "arrival_timeout_s, auth_key, auth_key_file, fetch_wait_s, host, "
                          "max_bytes, max_inflight, num_threads, peers, port, timeout_s, "
                          "unbound_store_timeout_s"),
]


@pytest.mark.parametrize("cfg,message", BAD, ids=[m.split(":")[0] + str(i)
                                                  for i, (_, m) in enumerate(BAD)])
def test_bad_value_names_its_key(cfg, message):
    with pytest.raises(TierError) as info:
        parse_config(cfg)
    assert str(info.value).startswith(message)
    assert SECRET not in str(info.value)


def test_defaults_and_peer_forms():
    cfg = parse_config(OK | {"peers": ["10.0.0.2:7000", "[::1]:7001", "10.0.0.2:7000"]})
    assert (cfg.host, cfg.advertise_host, cfg.port, cfg.num_threads, cfg.timeout_s,
            cfg.max_inflight) == ("127.0.0.1", "127.0.0.1", 0, 4, 5.0, 16)
    assert cfg.peers == (("10.0.0.2", 7000), ("::1", 7001))
    assert cfg.auth_key == SECRET.encode()


def test_wildcard_bind_with_an_advertised_address_is_accepted():
    cfg = parse_config(OK | {"host": "0.0.0.0", "advertise_host": "10.1.2.3"})
    assert (cfg.host, cfg.advertise_host) == ("0.0.0.0", "10.1.2.3")


def test_auth_key_file_is_read_and_stripped(tmp_path):
    path = tmp_path / "key"
    path.write_text(SECRET + "\n")
    assert parse_config({"auth_key_file": str(path)}).auth_key == SECRET.encode()
    with pytest.raises(TierError, match=r"^auth_key_file: cannot read '/nonexistent/k' \("):
        parse_config({"auth_key_file": "/nonexistent/k"})


def test_key_never_in_repr_of_config_or_tier():
    cfg = parse_config(OK)
    host, _ = host_region(1 << 20)
    tier = P2PTier(OK, host, NAMESPACE)
    try:
        assert SECRET not in repr(cfg) and SECRET not in repr(tier)
        assert SECRET not in str(tier.stats())
    finally:
        tier.close()


def test_engine_config_error_carries_the_list_position():
    config = parse_engine_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
        {"type": "p2p", "auth_key": SECRET, "peers": ["x:1", "nope"]}]})
    host, _ = host_region(1 << 20)
    with pytest.raises(ConfigError) as info:
        build_manager(config, host_geometry(4096, 1 << 20), host, NAMESPACE)
    assert str(info.value).startswith("secondary_tiers[0].peers[1]: must be \"host:port\"")


@pytest.mark.parametrize("port,index,message", [
    (65535, 1, "secondary_tiers[0].port: 65535 + data-parallel index 1 = 65536 exceeds 65535"),
    (7000, -1, "secondary_tiers[0].port: the data-parallel index must be an integer >= 0, "
               "got -1"),
], ids=["past-65535", "negative"])
def test_a_data_parallel_port_outside_the_port_range_names_port_and_index(port, index,
                                                                         message):
    """The engine's data-parallel index moves the listener to `port` + index (vLLM's rule);
    a sum past 65535 or a negative index is refused naming both, not bound elsewhere."""
    config = parse_engine_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
        {"type": "p2p", "auth_key": SECRET, "port": port}]})
    host, _ = host_region(1 << 20)
    with pytest.raises(ConfigError) as info:
        build_manager(config, host_geometry(4096, 1 << 20), host, NAMESPACE,
                      data_parallel_index=index)
    assert str(info.value) == message
