"""The side channel's messages (``side_channel.py`` carries them): a closed
tagged union of msgspec ``Struct`` types with every field bounded, their
msgpack decoders (typed: nothing is deserialized into code) and the one
encoder. What each message means: ``side_channel.py``'s docstring."""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

MAX_ID_CHARS = 256  # vLLM request ids are ~50 characters
MAX_BLOCKS = 1 << 20  # manifest entries, block ids
MAX_CACHES = 1 << 14  # registered caches (layers x caches per layer)
MAX_READERS = 1024  # decode ranks of one request
MAX_WIRE_LEASE_S = 3600.0  # what a message may carry; the prefill caps claims lower
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError)

# ---- message schema ---------------------------------------------------------
Nonce = Annotated[bytes, Meta(min_length=16, max_length=16)]
ReplyNonce = Annotated[bytes, Meta(max_length=16)]  # empty: reply to a malformed message
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Token = Annotated[str, Meta(min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]
ReaderId = Annotated[str, Meta(min_length=1, max_length=64)]
ShortStr = Annotated[str, Meta(max_length=64)]
U32 = Annotated[int, Meta(ge=0, lt=1 << 32)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack ints are at most 64-bit
BlockId = Annotated[int, Meta(ge=0, lt=1 << 31)]


def redacted_repr(struct, secret: str) -> str:
    """``Type(field=value, ...)`` with the ``secret`` field's value hidden:
    a transfer token is the key to its request's KV (docs/disaggregated.md,
    Security), so no repr a log line may print shows it."""
    parts = (f"{f}={'<redacted>' if f == secret else repr(getattr(struct, f))}"
             for f in struct.__struct_fields__)
    return f"{type(struct).__name__}({', '.join(parts)})"


class Fetch(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: this request's handshake and manifest. Claims the
    blocks for ``lease_s`` (capped by the prefill) for reader ``reader``."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId
    lease_s: Annotated[float, Meta(gt=0, le=MAX_WIRE_LEASE_S)]

    def __repr__(self) -> str:
        return redacted_repr(self, "token")


class Done(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: ``reader`` has read (or given up on) the blocks;
    the prefill frees them once ``readers`` distinct readers are done."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId
    readers: Annotated[int, Meta(ge=1, le=MAX_READERS)]

    def __repr__(self) -> str:
        return redacted_repr(self, "token")


class Release(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: ``reader`` gave up (the request failed) and reads
    nothing more; its claim ends now. Frees nothing (the blocks expire)."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId

    def __repr__(self) -> str:
        return redacted_repr(self, "token")


class TransportMeta(Struct, forbid_unknown_fields=True):
    """What a reader needs to reach the prefill rank's memory (NIXL: agent
    name and metadata; Mooncake: its RPC session ``host:port``)."""

    agent_name: Annotated[str, Meta(max_length=128)] = ""
    agent_metadata: Annotated[bytes, Meta(max_length=1 << 20)] = b""
    session: Annotated[str, Meta(max_length=300)] = ""
    # NIXL: where the registered caches live (host memory, or a GPU's index)
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: Annotated[int, Meta(ge=0, lt=1 << 16)] = 0


class ShardLayout(Struct, frozen=True, forbid_unknown_fields=True):
    """The worker's shard geometry, whole (``integration/geometry.py``
    ``ShardGeometry``: rank, size, block size, ownership rule, axis)."""

    rank: Annotated[int, Meta(ge=0, lt=MAX_READERS)]
    size: Annotated[int, Meta(ge=1, le=MAX_READERS)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]
    rule: ShortStr
    axis: ShortStr = "tp"

    @classmethod
    def of(cls, geometry) -> "ShardLayout":
        return cls(rank=geometry.rank, size=geometry.size, block_size=geometry.block_size,
                   rule=geometry.rule, axis=geometry.axis)


class Handshake(Struct, forbid_unknown_fields=True):
    """A prefill rank's cache layout (one entry per registered cache)."""

    engine_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)]
    shard: ShardLayout
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 31)]
    block_bytes: Annotated[list[Annotated[int, Meta(ge=1, lt=1 << 32)]],
                           Meta(max_length=MAX_CACHES)]
    dtype: Annotated[list[ShortStr], Meta(max_length=MAX_CACHES)]
    layer_addrs: Annotated[list[U64], Meta(max_length=MAX_CACHES)]
    transport: ShortStr
    transport_meta: TransportMeta
    # vLLM's --kv-cache-dtype (normalized: ``cache_format``): two FP8 formats
    # are the same torch dtype (uint8) and page size, but not the same bytes
    cache_format: ShortStr = "auto"


def cache_format(kv_cache_dtype) -> str:
    """vLLM's ``--kv-cache-dtype`` as the format of the cache's bytes: an
    FP8 format by name (``fp8`` is ``fp8_e4m3``, vLLM's meaning on CUDA),
    else ``auto``: a 16-bit cache's format is its torch dtype, which the
    handshake's ``dtype`` carries (``auto`` on a bf16 model and ``bfloat16``
    hold the same bytes). vLLM's per-layer FP8 scales are not compared: both
    sides must load them alike (the same checkpoint; no ``calculate_kv_scales``
    on one side only)."""
    name = str(kv_cache_dtype or "auto")
    if not name.startswith("fp8"):
        return "auto"
    return "fp8_e4m3" if name == "fp8" else name


class FetchReply(Struct, tag=True, forbid_unknown_fields=True):
    """Prefill -> decode: the handshake, this rank's manifest
    ``[(logical block, block id)]`` and the granted claim (seconds)."""

    nonce: ReplyNonce
    handshake: Handshake
    manifest: Annotated[list[tuple[U32, BlockId]], Meta(max_length=MAX_BLOCKS)]
    lease_s: Annotated[float, Meta(gt=0, le=MAX_WIRE_LEASE_S)]


class Ok(Struct, tag=True, forbid_unknown_fields=True):
    nonce: ReplyNonce


class Error(Struct, tag=True, forbid_unknown_fields=True):
    nonce: ReplyNonce
    reason: Annotated[str, Meta(max_length=1024)]


Request = Union[Fetch, Done, Release]


REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
REPLY_DECODERS = {t: msgspec.msgpack.Decoder(Union[t, Error]) for t in (FetchReply, Ok)}
ENCODER = msgspec.msgpack.Encoder()
