"""State-sync messages: the manifest and fetch requests a joiner sends a donor, and their validation.

Everything a donor declares is bounded here before it is used (counts, name lengths, dims, total
elements); ``peer/transport/state_sync.py`` then checks a manifest against the joiner's own layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from locomm.protocol.messages import ErrorCode, Message, ProtocolViolation, envelope


def state_manifest_header(run_id: str, sender: str) -> dict[str, Any]:
    return envelope(run_id, "state_manifest", 0, sender)


def state_fetch_header(run_id: str, sender: str, names: list[str], state_hash: str) -> dict[str, Any]:
    return envelope(run_id, "state_fetch", 0, sender, names=names, state_hash=state_hash)


MAX_NAMES_PER_REQUEST = 4096
"""Tensor names one state fetch may ask for."""
MAX_MANIFEST_ENTRIES = 16384
"""Tensors one state manifest may list (a 1B-parameter Llama with its outer state has about 600)."""
MAX_NAME_BYTES = 512
"""Length of one tensor name in a manifest or a fetch."""
MAX_DIMS = 8
"""Dimensions of one manifest tensor."""
MAX_STATE_ELEMS = 1 << 34
"""Elements of a whole manifest (64 GiB of fp32): a ceiling on what any donor may declare. The joiner
checks each manifest against its own model's layout on top of this (``peer/transport/state_sync.py``)."""
STATE_DTYPES = ("float32",)
"""The dtypes a state tensor travels in (a snapshot is fp32)."""


def _is_digest(x: Any) -> bool:
    """A hex sha256 (64 characters)."""
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _is_name(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_NAME_BYTES


def validate_state_fetch(msg: Message, known: Mapping[str, Any]) -> tuple[list[str], str]:
    """The names (each known, none repeated, at most ``MAX_NAMES_PER_REQUEST``) and the state hash asked for."""
    names, h = msg.fields.get("names"), msg.fields.get("state_hash")
    if (
        not isinstance(names, list)
        or not 0 < len(names) <= MAX_NAMES_PER_REQUEST
        or not all(_is_name(n) and n in known for n in names)
        or len(set(names)) != len(names)
    ):
        raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, "unknown, repeated or too many tensor names")
    if not _is_digest(h):
        raise ProtocolViolation(ErrorCode.MALFORMED, "state_hash missing or not a sha256")
    return names, h


def validate_manifest(
    resp: Mapping[str, Any], max_elems: int = MAX_STATE_ELEMS
) -> tuple[int, str, list[dict[str, Any]]]:
    """A donor's manifest answer, checked for form and bounds before anything is sized from it.

    Returns ``(round, state_hash, entries)``; each entry is ``{"name", "shape", "dtype", "sha256"}`` with
    ``shape`` a list of ints and ``dtype`` one of ``STATE_DTYPES`` (``float32`` when the donor left it out).
    Bounded: at most ``MAX_MANIFEST_ENTRIES`` entries, names unique and at most ``MAX_NAME_BYTES`` long, at
    most ``MAX_DIMS`` dimensions of at most 2^32 each, and ``max_elems`` elements in all (``TOO_LARGE``),
    counted before any caller allocates. Whether the layout is the one the joiner's model has is the
    caller's check.
    """
    h, rnd, man = resp.get("state_hash"), resp.get("round"), resp.get("manifest")
    if not _is_digest(h) or type(rnd) is not int or not 0 <= rnd < 1 << 63 or not isinstance(man, list):
        raise ProtocolViolation(ErrorCode.MALFORMED, "manifest answer lacks state_hash, round or manifest")
    if len(man) > MAX_MANIFEST_ENTRIES:
        raise ProtocolViolation(ErrorCode.TOO_LARGE, f"{len(man)} manifest entries (at most {MAX_MANIFEST_ENTRIES})")
    clean: list[dict[str, Any]] = []
    seen: set[str] = set()
    total = 0
    for m in man:
        shape = m.get("shape") if isinstance(m, dict) else None
        if (
            not isinstance(m, dict)
            or not _is_name(m.get("name"))
            or not _is_digest(m.get("sha256"))
            or not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(type(x) is int and 0 <= x <= 1 << 32 for x in shape)
        ):
            raise ProtocolViolation(ErrorCode.MALFORMED, "bad manifest entry")
        dtype = m.get("dtype", "float32")
        if dtype not in STATE_DTYPES:
            raise ProtocolViolation(ErrorCode.MALFORMED, f"manifest dtype {str(dtype)[:32]!r} is not fp32")
        if m["name"] in seen:
            raise ProtocolViolation(ErrorCode.MALFORMED, f"manifest names {m['name']!r} twice")
        seen.add(m["name"])
        total += math.prod(shape)
        if total > max_elems:
            raise ProtocolViolation(ErrorCode.TOO_LARGE, f"manifest declares over {max_elems} elements")
        clean.append({"name": m["name"], "shape": list(shape), "dtype": dtype, "sha256": m["sha256"]})
    return rnd, h, clean
