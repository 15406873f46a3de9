"""Length-prefixed JSON messages between the HTTP server and its fork servers."""

from __future__ import annotations

import json
import struct
from typing import Any

_HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 256 << 20


def encode(message: dict[str, Any]) -> bytes:
    """One message: a 4-byte big-endian length, then UTF-8 JSON."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def take_messages(buffer: bytearray) -> list[dict[str, Any]]:
    """Remove every complete message from the front of ``buffer`` and return them decoded."""
    messages = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"peer sent a message of {size} bytes (limit {MAX_MESSAGE_BYTES})")
        if len(buffer) < _HEADER.size + size:
            break
        messages.append(json.loads(bytes(buffer[_HEADER.size : _HEADER.size + size])))
        del buffer[: _HEADER.size + size]
    return messages
