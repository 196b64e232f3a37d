"""Seeds that every process derives alike from the same facts."""

from __future__ import annotations

import hashlib


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any values, the same in every process (unlike Python's ``hash``)."""
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
