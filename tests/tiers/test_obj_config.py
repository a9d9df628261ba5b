"""obj tier config: vLLM-compatible keys, exact errors naming the key path, secrets hidden."""
from __future__ import annotations

import pytest

from kvhal.config import ConfigError, build_tiers, parse_config as parse_engine_config
from kvhal.tier import TierError
from kvhal.tiers.obj import parse_config
from kvhal.tiers.obj.client import S3Client

SECRET = "s3cr3t-VALUE-that-must-not-leak"
STORE = {"bucket": "kv-cache", "endpoint_override": "minio.local:9000"}


def test_a_vllm_obj_tier_entry_is_accepted_as_is():
    cfg = parse_config({"type": "obj", "prefix": "/fleet/a/", "io_threads": 8,
                        "store_config": STORE | {"scheme": "https", "region": "eu-west-1",
                                                 "access_key": "AK", "secret_key": SECRET,
                                                 "session_token": "", "ca_bundle": ""}})

    assert (cfg.store.bucket, cfg.store.endpoint, cfg.store.region) == (
        "kv-cache", "https://minio.local:9000", "eu-west-1")
    assert (cfg.store.access_key, cfg.store.secret_key, cfg.store.session_token,
            cfg.store.ca_bundle) == ("AK", SECRET, None, None)
    assert (cfg.prefix, cfg.io_threads, cfg.max_bytes, cfg.refresh_interval_s,
            cfg.timeout_s) == ("fleet/a", 8, 100 << 30, 5.0, 20.0)


@pytest.mark.parametrize("endpoint,scheme,expected", [
    ("127.0.0.1:5000", None, "http://127.0.0.1:5000"),          # vLLM's default scheme
    ("http://127.0.0.1:5000/", None, "http://127.0.0.1:5000"),
    ("https://s3.example.com", "https", "https://s3.example.com"),
    (None, None, None),                                           # AWS S3 of the region
], ids=["host-port", "url", "https", "aws"])
def test_endpoint_forms(endpoint, scheme, expected):
    store = {"bucket": "kv-cache"} | ({"endpoint_override": endpoint} if endpoint else {}) \
        | ({"scheme": scheme} if scheme else {})
    assert parse_config({"store_config": store}).store.endpoint == expected


@pytest.mark.parametrize("config,message", [
    ({}, "store_config: required object with at least \"bucket\"; got NoneType"),
    ({"store_config": STORE, "root_dir": "/x"},
     "root_dir: unknown key for the obj tier; accepted: io_threads, max_bytes, prefix, "
     "refresh_interval_s, store_config, timeout_s"),
    ({"store_config": STORE | {"bukket": "x"}},
     "store_config.bukket: unknown key; accepted: bucket, endpoint_override, scheme, region, "
     "access_key, secret_key, session_token, ca_bundle"),
    ({"store_config": {"bucket": "A_b"}},
     "store_config.bucket: required, 3-63 characters of a-z 0-9 . - starting and ending with "
     "a letter or digit; got 'A_b'"),
    ({"store_config": STORE | {"scheme": "ftp"}},
     "store_config.scheme: must be \"http\" or \"https\", got 'ftp'"),
    ({"store_config": STORE | {"endpoint_override": "http://a b"}},
     "store_config.endpoint_override: must be host[:port] or scheme://host[:port] with a port "
     "in 1..65535, got 'http://a b'"),
    ({"store_config": STORE | {"endpoint_override": "127.0.0.1:99999"}},  # was a Rust panic
     "store_config.endpoint_override: must be host[:port] or scheme://host[:port] with a port "
     "in 1..65535, got '127.0.0.1:99999'"),
    ({"store_config": STORE | {"endpoint_override": f"http://ak:{SECRET}@h:1"}},
     "store_config.endpoint_override: must be host[:port] or scheme://host[:port] with a port "
     "in 1..65535, got 'http://***@h:1'"),
    ({"store_config": STORE | {"region": "us east 1"}},
     "store_config.region: 1-64 letters, digits and _.- expected, got 'us east 1'"),
    ({"store_config": STORE | {"endpoint_override": "http://h:1", "scheme": "https"}},
     "store_config.scheme: 'https' contradicts endpoint_override 'http://h:1'"),
    ({"store_config": STORE | {"access_key": "AK"}},
     "store_config.secret_key: access_key and secret_key go together (give both, or neither "
     "to use the AWS credential chain)"),
    ({"store_config": STORE, "prefix": "a//b"},
     "prefix: segments between \"/\" must be non-empty, not \".\" or \"..\", of letters, "
     "digits and !_.*'()=+,;@~-; got 'a//b'"),
    ({"store_config": STORE, "io_threads": 0}, "io_threads: must be an integer in [1, 1024], "
                                               "got 0"),
    ({"store_config": STORE, "max_bytes": True},
     f"max_bytes: must be an integer in [1, {1 << 62}], got True"),
    ({"store_config": STORE, "timeout_s": float("nan")},
     "timeout_s: must be a number in [0.05, 3600.0], got nan"),
    ({"store_config": STORE, "refresh_interval_s": 0},
     "refresh_interval_s: must be a number in [0.001, 86400.0], got 0"),
    ({"store_config": STORE, "max_bytes": 10**400},      # once an OverflowError from isfinite
     f"max_bytes: must be an integer in [1, {1 << 62}], got {'1' + '0' * 36}..."),
], ids=lambda p: p if isinstance(p, str) and len(p) < 30 else None)
def test_bad_values_name_the_key(config, message):
    with pytest.raises(TierError) as exc:
        parse_config(config)
    assert str(exc.value) == message


@pytest.mark.parametrize("key", ["access_key", "secret_key", "session_token"])
def test_a_secret_of_the_wrong_type_is_refused_without_showing_it(key):
    value = [SECRET]
    with pytest.raises(TierError) as exc:
        parse_config({"store_config": STORE | {"access_key": "AK", "secret_key": "SK", key: value}})
    assert str(exc.value) == f"store_config.{key}: must be a string"


@pytest.mark.parametrize("content", [b"", b"not a certificate"], ids=["empty", "garbage"])
def test_a_ca_bundle_without_a_certificate_is_one_error_naming_the_key(tmp_path, content):
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(content)
    store = parse_config({"store_config": STORE | {"ca_bundle": str(bundle), "access_key": "AK",
                                                   "secret_key": SECRET}}).store
    with pytest.raises(TierError) as exc:
        S3Client(store, 1.0, 2)
    assert str(exc.value) == (f"store_config.ca_bundle: {str(bundle)!r} holds no PEM-encoded "
                              f"certificate")


def test_secrets_are_not_in_the_repr():
    cfg = parse_config({"store_config": STORE | {"access_key": "AKIA-ID", "secret_key": SECRET,
                                                 "session_token": SECRET + "-token"}})
    text = repr(cfg) + str(cfg) + repr(cfg.store)
    assert SECRET not in text and "AKIA-ID" not in text
    assert cfg.store.describe() == "bucket 'kv-cache' at endpoint http://minio.local:9000"


def test_engine_config_errors_carry_the_nested_key_path():
    config = parse_engine_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
        {"type": "obj", "store_config": {"bucket": "x"}}]})
    with pytest.raises(ConfigError) as exc:
        build_tiers(config, memoryview(bytearray(4096)), bytes(16))
    assert exc.value.path == "secondary_tiers[0].store_config.bucket"
