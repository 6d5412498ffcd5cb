"""``kv_transfer_params``: the schema the decode accepts, and where it is checked.

The prefill returns them to its HTTP client (usually a proxy), which sends
them on to the decode: on the decode they are **client input**. They are
checked strictly (msgspec, strict types: an int is an int, not ``"5"``,
``True`` or ``5.0``; bounded strings, ports 1..65535) twice:

* in the frontend (:func:`check_request_params`, installed by the plugin
  around vLLM's ``InputProcessor._validate_params``, plugin.py item 7): a bad request is refused with HTTP 400 and the reason
  before it reaches the engine;
* in the decode's scheduler (:func:`check_params`), which also knows the
  prompt's length; what fails there fails the request's KV load (HTTP 500,
  reason in the decode log: vLLM 0.32 has no way for a connector to give a
  failed load a message).

``remote_block_ids`` is not used any more (each prefill rank keeps its own
block table, and a manifest is handed out only for the right token); if a
client still sends it, it must be a bounded list of block ids and is ignored.
Unknown keys are ignored (routers may add their own).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from ...core.ownership import CYCLIC, num_logical_blocks
from .config import ConnectorConfig, host_allowed
from .schema import MAX_BLOCKS, MAX_ID_CHARS, MAX_READERS, RequestId, Token, redacted_repr

CONNECTOR = "ShardedKVConnector"
MAX_TOKENS = 1 << 26
Host = Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._:\-\[\]]+$")]


class TransferParams(Struct, forbid_unknown_fields=False):
    """What the decode reads from ``kv_transfer_params`` (made by the
    prefill's ``request_finished``)."""

    do_remote_prefill: Literal[True]
    remote_request_id: RequestId
    remote_host: Host
    remote_port: Annotated[int, Meta(ge=1, le=65535)]
    remote_num_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
    shard_size: Annotated[int, Meta(ge=1, le=MAX_READERS)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]
    transfer_token: Token
    ownership_rule: Literal["cyclic"] = CYCLIC
    transport: Literal["nixl", "mooncake"] = "nixl"
    do_remote_decode: bool = False
    remote_engine_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] = ""
    # not used (see the module docstring); checked, then ignored
    remote_block_ids: Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 31)]],
                                Meta(max_length=MAX_BLOCKS)] | None = None

    def __repr__(self) -> str:
        return redacted_repr(self, "transfer_token")


class ParamsError(ValueError):
    """``kv_transfer_params`` the decode must not act on."""


def parse_params(params, cfg: ConnectorConfig | None = None) -> TransferParams:
    """The checked params, or ParamsError with the reason. With ``cfg`` (the
    decode's config) also its transport and prefill allow-list."""
    if not isinstance(params, dict):
        raise ParamsError(f"malformed kv_transfer_params: expected an object, got "
                          f"{type(params).__name__}")
    try:
        p = msgspec.convert(params, TransferParams, strict=True)
    except msgspec.ValidationError as e:
        raise ParamsError(f"malformed kv_transfer_params: {e}") from None
    if p.remote_port + p.shard_size - 1 > 65535:
        raise ParamsError(f"malformed kv_transfer_params: ports {p.remote_port}.."
                          f"{p.remote_port + p.shard_size - 1} exceed 65535")
    if cfg is not None:
        if p.transport != cfg.transport:
            raise ParamsError(f"kv_transfer_params name transport {p.transport!r}, this "
                              f"decode runs {cfg.transport!r}")
        if p.shard_size > cfg.max_shard_size:
            raise ParamsError(f"kv_transfer_params name {p.shard_size} prefill ranks; this "
                              f"decode accepts at most {cfg.max_shard_size} (max_shard_size)")
        if not host_allowed(cfg.allowed_prefill_hosts, p.remote_host, p.remote_port):
            raise ParamsError(f"kv_transfer_params name prefill {p.remote_host}:"
                              f"{p.remote_port}, which allowed_prefill_hosts does not list")
    return p


def check_params(params, num_prompt_tokens: int, cfg: ConnectorConfig | None = None
                 ) -> tuple[TransferParams | None, str | None]:
    """Scheduler side: ``(params, None)`` or ``(None, why they cannot be used)``."""
    try:
        p = parse_params(params, cfg)
    except ParamsError as e:
        return None, str(e)
    if p.remote_num_tokens != num_prompt_tokens:
        return None, (f"kv_transfer_params cover {p.remote_num_tokens} tokens but the "
                      f"prompt has {num_prompt_tokens}")
    if num_logical_blocks(p.remote_num_tokens, p.block_size) > MAX_BLOCKS:
        return None, "kv_transfer_params: request too large"
    return p, None


# ---- frontend: HTTP 400 for bad params -----------------------------------------
def is_sharded_kv_connector(kv_transfer_config) -> bool:
    return (kv_transfer_config is not None
            and getattr(kv_transfer_config, "kv_connector", None) == CONNECTOR
            and str(getattr(kv_transfer_config, "kv_connector_module_path", None) or ""
                    ).startswith("vllm_cp_kv."))


def check_request_params(vllm_config, sampling_params) -> None:
    """Refuse a request whose ``kv_transfer_params`` the connector would
    refuse, with ``VLLMValidationError`` (HTTP 400 and the reason).

    Inert unless the configured connector is ShardedKVConnector. On the decode
    (consumer) params asking for a remote prefill are checked in full,
    including the allow-list; on the prefill (producer) only their shape."""
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    if not is_sharded_kv_connector(cfg):
        return
    extra_args = getattr(sampling_params, "extra_args", None) or {}
    if "kv_transfer_params" not in extra_args or extra_args["kv_transfer_params"] is None:
        return
    from vllm.exceptions import VLLMValidationError

    params = extra_args["kv_transfer_params"]
    if not isinstance(params, dict):
        raise VLLMValidationError("malformed kv_transfer_params: expected an object",
                                  parameter="kv_transfer_params")
    for key in ("do_remote_prefill", "do_remote_decode"):
        if not isinstance(params.get(key, False), bool):
            raise VLLMValidationError(f"malformed kv_transfer_params: {key} must be a boolean",
                                      parameter="kv_transfer_params")
    if params.get("do_remote_prefill") and cfg.is_kv_consumer:
        try:
            parse_params(params, _config(cfg))
        except ParamsError as e:
            raise VLLMValidationError(str(e), parameter="kv_transfer_params") from None


def _config(kv_transfer_config) -> ConnectorConfig:
    return ConnectorConfig.from_extra(kv_transfer_config.kv_connector_extra_config,
                                      kv_transfer_config.is_kv_producer)
