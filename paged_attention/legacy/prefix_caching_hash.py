"""How prefix caching names a full block: a hash of its tokens chained to the hash of the block
before it, so that equal hashes mean equal whole prefixes.

Both the blocks (``prefix_caching_block``) and the block manager's per-sequence tracker
(``prefix_caching_trackers``) hash this way, and must agree to the bit: a tracker finds cached
blocks by hashing a sequence's raw token ids exactly as the blocks hashed themselves.
"""
from __future__ import annotations

import hashlib
from typing import Optional


def stable_hash(text: str) -> int:
    """A 64-bit signed int from ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


NONE_HASH: int = stable_hash("None")
"""The "previous hash" of a first block. vLLM uses ``hash('None')``, which changes from process to
process; a fixed value keeps hashes printable and comparable across runs."""


def hash_block_tokens(is_first_block: bool, prev_block_hash: Optional[int], cur_block_token_ids: list[int],
                      extra_hash: Optional[int] = None, none_hash: int = NONE_HASH) -> int:
    """Hash a block's tokens together with the hash of everything before it.

    Python's ``hash`` of a tuple of ints is the same in every process; ``None`` (whose hash is
    not, before Python 3.12) is kept out of the tuple: a missing previous hash becomes
    ``none_hash`` and a missing ``extra_hash`` a flag.
    """
    if prev_block_hash is None:
        prev_block_hash = none_hash
    has_extra = extra_hash is not None
    return hash((is_first_block, prev_block_hash, has_extra, extra_hash if has_extra else 0, *cur_block_token_ids))
