"""``kv_transfer_params`` are client input on the decode: the strict schema
(ints are ints, bounded strings, ports 1..65535), the prefill allow-list,
the connector's extra config, and the frontend hook that turns a refusal
into HTTP 400 (``check_request_params`` / ``patch_input_processor``).

On the previous connector numeric strings and ``remote_block_ids`` of 10**12
were accepted (``int(...)`` casts) and a client could name any prefill host."""

import secrets
from types import SimpleNamespace

import pytest

from conftest import needs_vllm
from pd_support import skip_or_fail

try:
    import msgspec  # noqa: F401
except ImportError:  # a vLLM dependency
    skip_or_fail("msgspec (a vLLM dependency) is not installed")

from vllm_cp_kv.integration.connector.config import ConnectorConfig, host_allowed  # noqa: E402
from vllm_cp_kv.integration.connector.params import (ParamsError, check_params,  # noqa: E402
                                                     parse_params)

TOKEN = secrets.token_urlsafe(32)
GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
        "remote_request_id": "cmpl-1-0-abcd", "remote_host": "10.0.0.1", "remote_port": 5700,
        "remote_num_tokens": 40, "shard_size": 2, "block_size": 16, "ownership_rule": "cyclic",
        "transport": "nixl", "transfer_token": TOKEN}
REQUIRED = ("do_remote_prefill", "remote_request_id", "remote_host", "remote_port",
            "remote_num_tokens", "shard_size", "block_size", "transfer_token")


def test_the_prefills_params_are_accepted():
    p = parse_params(dict(GOOD, some_router_key={"x": 1}))  # unknown keys: ignored
    assert (p.remote_host, p.remote_port, p.shard_size) == ("10.0.0.1", 5700, 2)
    # the schema has no test fields: the P/D test hooks' keys (patched in from
    # scripts/gpu/onegpu/pd_hooks.py) are unknown keys to it
    p = parse_params(dict(GOOD, cp_kv_test_pause_s=10 ** 6, cp_kv_test_ignore_positions=1))
    assert not hasattr(p, "cp_kv_test_pause_s") and not hasattr(p, "cp_kv_test_ignore_positions")
    assert parse_params(dict(GOOD, remote_block_ids=[0, 5, 7])).remote_block_ids == [0, 5, 7]


@pytest.mark.parametrize("key,value", [
    ("remote_port", "5700"), ("remote_port", True), ("remote_port", 5700.0),
    ("remote_port", 70000), ("remote_port", 0), ("remote_port", -1),
    ("remote_num_tokens", "40"), ("remote_num_tokens", 10 ** 12), ("remote_num_tokens", 0),
    ("shard_size", 0), ("shard_size", 10 ** 6), ("shard_size", "2"), ("block_size", 16.0),
    ("remote_host", 12), ("remote_host", ""), ("remote_host", "h" * 300),
    ("remote_host", "evil;tcp://10.0.0.2:1"), ("remote_host", "a b"),
    ("remote_request_id", ""), ("remote_request_id", "x" * 1000), ("remote_request_id", 7),
    ("transfer_token", "short"), ("transfer_token", 12345678901234567890),
    ("transfer_token", "t" * 200), ("transfer_token", "not a token at all!!"),
    ("remote_block_ids", [10 ** 12]), ("remote_block_ids", ["1"]), ("remote_block_ids", [-5]),
    ("remote_block_ids", "1,2,3"), ("remote_block_ids", [True]),
    ("do_remote_prefill", "yes"), ("do_remote_prefill", 1),
    ("transport", "tcp"), ("ownership_rule", "blocked"),
])
def test_wrongly_typed_or_out_of_range_params_are_refused(key, value):
    with pytest.raises(ParamsError, match="malformed kv_transfer_params") as e:
        parse_params(dict(GOOD, **{key: value}))
    assert key in str(e.value)  # the message names the field


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_keys_are_refused(key):
    with pytest.raises(ParamsError, match=f"missing required field `{key}`"):
        parse_params({k: v for k, v in GOOD.items() if k != key})


@pytest.mark.parametrize("params", [None, [GOOD], "params", 5])
def test_params_that_are_not_an_object_are_refused(params):
    with pytest.raises(ParamsError, match="expected an object"):
        parse_params(params)


def test_ports_of_the_last_rank_must_exist():
    with pytest.raises(ParamsError, match="exceed 65535"):
        parse_params(dict(GOOD, remote_port=65535, shard_size=2))


def test_the_prompt_length_must_match():
    assert check_params(GOOD, 40)[1] is None
    p, error = check_params(GOOD, 41)
    assert p is None and "cover 40 tokens but the prompt has 41" in error


@pytest.mark.parametrize("allowed,host,port,ok", [
    (None, "203.0.113.9", 1, True),
    (("10.0.0.1",), "10.0.0.1", 5700, True),
    (("10.0.0.1",), "10.0.0.2", 5700, False),
    (("10.0.0.1:5700",), "10.0.0.1", 5700, True),
    (("10.0.0.1:5700",), "10.0.0.1", 5800, False),
    (("Prefill-0.Internal",), "prefill-0.internal", 5700, True),
    (("[::1]:5700", "fd00::2"), "::1", 5700, True),
    (("[::1]:5700", "fd00::2"), "fd00::2", 1234, True),
    (("[::1]:5700",), "::1", 5701, False),
    ((), "10.0.0.1", 5700, False),
])
def test_the_prefill_allow_list(allowed, host, port, ok):
    assert host_allowed(allowed, host, port) is ok


def test_the_decode_refuses_a_prefill_host_off_its_allow_list():
    cfg = ConnectorConfig.from_extra({"allowed_prefill_hosts": ["10.0.0.1:5700"]}, False)
    assert parse_params(GOOD, cfg).remote_host == "10.0.0.1"
    with pytest.raises(ParamsError, match="allowed_prefill_hosts does not list"):
        parse_params(dict(GOOD, remote_host="203.0.113.9"), cfg)
    with pytest.raises(ParamsError, match="transport 'mooncake'"):
        parse_params(dict(GOOD, transport="mooncake"), cfg)


# ---- extra config ------------------------------------------------------------------------
def test_extra_config_refuses_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        ConnectorConfig.from_extra({"allowed_prefil_hosts": ["x"]}, False)
    for extra in ({"side_channel_port": "5700"}, {"transfer_timeout_s": True},
                  {"allowed_prefill_hosts": "10.0.0.1"}, {"transport": "tcp"}):
        with pytest.raises(ValueError):
            ConnectorConfig.from_extra(extra, False)


def test_the_secret_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("VLLM_CP_KV_SIDE_CHANNEL_SECRET", raising=False)
    assert ConnectorConfig.from_extra({}, True).secret is None
    monkeypatch.setenv("VLLM_CP_KV_SIDE_CHANNEL_SECRET", "s" * 32)
    assert ConnectorConfig.from_extra({}, True).secret == b"s" * 32
    assert "s" * 32 not in repr(ConnectorConfig.from_extra({}, True))
    monkeypatch.setenv("MY_SECRET", "m" * 20)
    assert ConnectorConfig.from_extra({"side_channel_secret_env": "MY_SECRET"}, True
                                      ).secret == b"m" * 20
    with pytest.raises(ValueError, match="not set"):
        ConnectorConfig.from_extra({"side_channel_secret_env": "UNSET_SECRET_X"}, True)
    monkeypatch.setenv("VLLM_CP_KV_SIDE_CHANNEL_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16"):
        ConnectorConfig.from_extra({}, True)


# ---- frontend: HTTP 400 ---------------------------------------------------------------------
def vllm_config(role="kv_consumer", connector="ShardedKVConnector", extra=None):
    kv = SimpleNamespace(kv_connector=connector,
                         kv_connector_module_path="vllm_cp_kv.integration.connector",
                         kv_connector_extra_config=extra or {},
                         is_kv_consumer=role == "kv_consumer",
                         is_kv_producer=role == "kv_producer")
    return SimpleNamespace(kv_transfer_config=kv)


def sampling(params):
    return SimpleNamespace(extra_args={"kv_transfer_params": params})


@needs_vllm
def test_the_frontend_refuses_bad_params_with_a_validation_error():
    from vllm.exceptions import VLLMValidationError

    from vllm_cp_kv.integration.connector.params import check_request_params

    check_request_params(vllm_config(), sampling(GOOD))  # fine
    check_request_params(vllm_config(), SimpleNamespace(extra_args=None))  # no params
    for bad, phrase in ((dict(GOOD, remote_port="5700"), "remote_port"),
                        ([1, 2], "expected an object"),
                        (dict(GOOD, do_remote_prefill="yes"), "do_remote_prefill")):
        with pytest.raises(VLLMValidationError, match=phrase):
            check_request_params(vllm_config(), sampling(bad))
    allow = vllm_config(extra={"allowed_prefill_hosts": ["10.0.0.9"]})
    with pytest.raises(VLLMValidationError, match="allowed_prefill_hosts"):
        check_request_params(allow, sampling(GOOD))
    # the prefill checks only the shape of its flag
    check_request_params(vllm_config("kv_producer"), sampling({"do_remote_decode": True}))
    with pytest.raises(VLLMValidationError, match="do_remote_decode"):
        check_request_params(vllm_config("kv_producer"), sampling({"do_remote_decode": "1"}))
    # inert for other connectors and without one
    check_request_params(vllm_config(connector="NixlConnector"), sampling([1, 2]))
    check_request_params(SimpleNamespace(kv_transfer_config=None), sampling([1, 2]))


@needs_vllm
def test_patch_input_processor_wraps_validate_params(monkeypatch):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_cp_kv.integration.plugin import _patch_input_processor as patch_input_processor

    calls = []

    def validate(self, params, supported_tasks):
        calls.append(params)
        return "vllm's result"

    monkeypatch.setattr(InputProcessor, "_validate_params", validate)
    patch_input_processor()
    patch_input_processor()  # idempotent: wrapped once
    processor = SimpleNamespace(vllm_config=vllm_config())
    assert InputProcessor._validate_params(processor, sampling(GOOD), ()) == "vllm's result"
    with pytest.raises(VLLMValidationError, match="remote_port"):
        InputProcessor._validate_params(processor, sampling(dict(GOOD, remote_port="1")), ())
    assert len(calls) == 2  # vLLM's own checks ran first, once each
