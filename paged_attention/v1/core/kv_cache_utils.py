"""Blocks, the free queue, and block hashes: the vocabulary of vLLM's V1 KV-cache core.

A ``KVCacheBlock`` is the bookkeeping for one physical block: its id, how many requests use it,
and, once it is full and cached, the hash of the tokens it holds (chained over every token
before it). Free blocks wait in a ``FreeKVCacheBlockQueue``, a doubly linked list threaded
through the blocks themselves, so that a cached block that is hit again can be pulled out of
the middle in O(1). The front of the queue is evicted first.

A request's block hashes are computed once per full block: the hash of block ``i`` covers the
hash of block ``i - 1``, the block's token ids and the request's extra keys (LoRA adapter, cache
salt); block 0 chains from ``NONE_HASH``, a fixed value derived from a seed, so the same tokens
hash the same in every process.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NewType

from paged_attention.v1.core.request import Request

# The hash of one block's prefix (bytes), and the same hash with the group id appended: the
# key under which a block of one KV-cache group is cached.
BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The cache key of ``block_hash`` in group ``group_id``: the group as 4 big-endian bytes
    after the hash (bytes, not a tuple: cheaper to build, hash and keep)."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


# --------------------------------------------------------------------------------------------
# Hash functions (vLLM's ``vllm/utils/hashing.py``)
# --------------------------------------------------------------------------------------------

def sha256(input: Any) -> bytes:
    """SHA-256 of the pickled ``input`` (pickle's highest protocol): any picklable object."""
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(input: Any) -> bytes:
    """SHA-256 of ``input`` in canonical CBOR: the same bytes from any language."""
    import cbor2  # only this hash needs it

    return hashlib.sha256(cbor2.dumps(input, canonical=True)).digest()


# The seed of NONE_HASH when PYTHONHASHSEED is not set: fixed, so that two processes hash the
# same prefix the same way (SHA-256 needs no secret seed to resist collisions).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _none_hash_seed() -> str:
    seed = os.getenv("PYTHONHASHSEED")
    return seed if seed is not None else DEFAULT_NONE_HASH_SEED


# Usable before any init_none_hash call: the sha256 of the seed.
NONE_HASH: BlockHash = BlockHash(sha256(_none_hash_seed()))


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Set ``NONE_HASH``, the parent of every request's first block, with ``hash_fn``.

    The seed is ``PYTHONHASHSEED`` when set, else a fixed string. (vLLM draws a random seed for
    its non-cryptographic xxhash functions; they are not offered here.)"""
    global NONE_HASH
    if not callable(hash_fn):
        raise TypeError(f"hash_fn must be a function of one argument, got {hash_fn!r}")
    NONE_HASH = BlockHash(hash_fn(_none_hash_seed()))


# --------------------------------------------------------------------------------------------
# A block, and the queue of free blocks
# --------------------------------------------------------------------------------------------

@dataclass(slots=True)
class KVCacheBlock:
    """One physical block's bookkeeping.

    ``ref_cnt`` counts the requests holding the block; at 0 it sits in the free queue (and may
    still be cached: a prefix hit takes it back out). ``block_hash`` is set once the block is
    full and cached, ``block_hash_num_tokens`` is the prefix length it stands for.
    ``prev_free_block`` / ``next_free_block`` are the free queue's links; only the queue
    touches them. The null block (id 0) stands for "no block here" and is never freed.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId,
                       num_tokens: int | None = None) -> None:
        if self._block_hash is not None:
            raise ValueError(f"block {self.block_id} already has a hash; reset it first")
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        """Forget the hash (the block is evicted from the prefix cache)."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        # Neighbours by id: the default repr would follow the links through the whole queue.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"block_hash={self._block_hash!r}, prev_free_block={prev_id}, "
                f"next_free_block={next_id})")


def null_head_len(blocks: Sequence[KVCacheBlock]) -> int:
    """How many null blocks open ``blocks`` (a sliding-window table's dropped prefix)."""
    n = 0
    while n < len(blocks) and blocks[n].is_null:
        n += 1
    return n


def trim_null_head(blocks: Sequence[KVCacheBlock]) -> Sequence[KVCacheBlock]:
    """``blocks`` without its leading null blocks."""
    n = null_head_len(blocks)
    return blocks[n:] if n else blocks


class FreeKVCacheBlockQueue:
    """The free blocks, in eviction order, as a doubly linked list through the blocks.

    A deque cannot drop an element from its middle in O(1), and a prefix hit on a free cached
    block must do exactly that. So each block carries its own links, and two sentinel blocks
    (id -1) stand before the first and after the last, which keeps every operation free of
    "is the list empty" branches. At first the queue holds the blocks in id order. The block
    pool decides where freed blocks go: never-cached ones at the front (reused first), cached
    ones at the back, a request's tail before its head (so its first block, the one most
    likely shared, is evicted last).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free_block = right
            right.prev_free_block = left

    def _check_linked(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")

    @staticmethod
    def _unlink(block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None

    def popleft(self) -> KVCacheBlock:
        """Take the block at the front (the next one to evict)."""
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        block = self.fake_free_list_head.next_free_block
        self._unlink(block)
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first ``n`` blocks, front first."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks: {self.num_free_blocks} are free")
        head = self.fake_free_list_head
        block = head.next_free_block
        taken = []
        for _ in range(n):
            # Clearing a taken block's links as the walk leaves it: nothing reads them again.
            taken.append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        # Relink the head to the first block left.
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the middle (a free cached block hit by a new request)."""
        self._check_linked(block)
        self._unlink(block)
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, blocks: Sequence[KVCacheBlock]) -> None:
        # One pass checks each block and links it. A queued block has a link, and the only
        # links set so far lead to this call's blocks, so a block already queued still shows
        # one when it is reached. Then the partial insertion is undone before the error.
        after = anchor.next_free_block
        prev = anchor
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                self._undo_insert(anchor, after, prev, blocks)
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    @staticmethod
    def _undo_insert(anchor: KVCacheBlock, after: KVCacheBlock, last: KVCacheBlock,
                     blocks: Sequence[KVCacheBlock]) -> None:
        """Unlink what ``_insert_after`` linked from ``anchor`` to ``last`` (``anchor`` itself
        pointed to ``after`` before) and raise for the first of ``blocks`` that was queued."""
        if last is not anchor:
            block = anchor.next_free_block
            while True:
                following = block.next_free_block
                block.prev_free_block = block.next_free_block = None
                if block is last:
                    break
                block = following
            anchor.next_free_block = after
        # The queue is as it was: name the first block queued before the call, or else the
        # first block given twice (this call had linked it already).
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
        seen = set()
        for block in blocks:
            if id(block) in seen:
                raise ValueError(f"block {block.block_id} is given twice")
            seen.add(id(block))
        raise AssertionError("_undo_insert called without a queued or repeated block")

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        self._insert_after(self.fake_free_list_tail.prev_free_block, [block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in their order."""
        if blocks:
            self._insert_after(self.fake_free_list_tail.prev_free_block, blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in their order (``blocks[0]`` is evicted first)."""
        if blocks:
            self._insert_after(self.fake_free_list_head, blocks)

    def iter_blocks_after(self, cursor: KVCacheBlock | None = None) -> Iterator[KVCacheBlock]:
        """The free blocks in eviction order, after ``cursor`` (from the front if None)."""
        block = (cursor or self.fake_free_list_head).next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front (evicted first) to back."""
        return list(self.iter_blocks_after())


# --------------------------------------------------------------------------------------------
# Block hashes of a request
# --------------------------------------------------------------------------------------------

def generate_block_hash_extra_keys(request: Request, start_token_idx: int, end_token_idx: int,
                                   start_mm_idx: int = 0) -> tuple[tuple[Any, ...] | None, int]:
    """What besides the token ids makes a block's KV differ: the LoRA adapter (its name and
    path, on every block) and the cache salt (on the first block only, which is enough: every
    later hash chains from it). ``(None, start_mm_idx)`` when there is nothing; multimodal
    inputs and prompt embeddings (vLLM's other extra keys) are not modelled here."""
    keys: list[Any] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    if start_token_idx == 0 and getattr(request, "cache_salt", None):
        keys.append(("cache_salt", request.cache_salt))
    return (tuple(keys) if keys else None), start_mm_idx


def hash_block_tokens(hash_function: Callable[[Any], bytes], parent_block_hash: BlockHash | None,
                      curr_block_token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> BlockHash:
    """The hash of one full block: ``hash_function((parent, token ids, extra keys))``, the
    parent being the previous block's hash, or ``NONE_HASH`` for the first block."""
    parent = parent_block_hash if parent_block_hash else NONE_HASH
    return BlockHash(hash_function((parent, tuple(curr_block_token_ids), extra_keys)))


def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Callable[[Any], bytes],
                             num_hash_lookahead_tokens: int = 0,
                             ) -> Callable[[Request], list[BlockHash]]:
    """A function giving the hashes of a request's full blocks not hashed yet.

    ``Request`` calls it on creation and whenever tokens are appended, and extends its
    ``block_hashes`` with the result: the hashes are computed once per block, at
    ``hash_block_size`` tokens (a group with larger blocks reads every k-th hash).
    ``num_hash_lookahead_tokens`` (vLLM's speculative-decoding variant) must be 0 here.
    """
    if isinstance(hash_block_size, bool) or not isinstance(hash_block_size, int) \
            or hash_block_size < 1:
        raise ValueError(f"hash_block_size must be an int >= 1, got {hash_block_size!r}")
    if not callable(caching_hash_fn):
        raise TypeError(f"caching_hash_fn must be callable, got {caching_hash_fn!r}")
    if num_hash_lookahead_tokens:
        raise ValueError("num_hash_lookahead_tokens (speculative decoding) is not modelled")

    pickled_sha256, new_sha256, dumps = caching_hash_fn is sha256, hashlib.sha256, pickle.dumps
    protocol = pickle.HIGHEST_PROTOCOL

    def request_block_hasher(request: Request) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes) * hash_block_size
        # Our Request's own list, which its num_tokens and all_token_ids view read (at a block
        # boundary every running request comes here at once); any other request: those two.
        own_ids = request._all_token_ids if type(request) is Request else None
        num_tokens = len(own_ids) if own_ids is not None else request.num_tokens
        if start + hash_block_size > num_tokens:
            return []   # no block filled: the common case, once per decoded token
        # The new full blocks' tokens, read once (one slice of the request's list or view), as
        # a tuple: each block's slice of it is then the tuple hash_block_tokens would make.
        end = num_tokens - (num_tokens - start) % hash_block_size
        tokens = tuple((own_ids if own_ids is not None else request.all_token_ids)[start:end])
        # A block's extra keys depend only on whether it is the request's first (the cache salt
        # goes there): looked up once per call, not once per block.
        later_keys, _ = generate_block_hash_extra_keys(request, hash_block_size,
                                                       2 * hash_block_size)
        # hash_block_tokens written out in the loop (a prompt hashes many blocks at once, each
        # call is pure overhead): the same triple, hashed the same way, an empty parent read as
        # NONE_HASH as it is at the time of the call (init_none_hash may change it).
        parent = block_hashes[-1] if block_hashes else None
        if end - start == hash_block_size:
            # One new block (a decode step that fills one: at a block boundary, every running
            # request at once): the loop's one turn, without the loop.
            keys = (later_keys if start else
                    generate_block_hash_extra_keys(request, 0, hash_block_size)[0])
            triple = (parent or NONE_HASH, tokens, keys)
            return [new_sha256(dumps(triple, protocol)).digest() if pickled_sha256
                    else caching_hash_fn(triple)]
        new_hashes: list[BlockHash] = []
        for i in range(0, end - start, hash_block_size):
            keys = (later_keys if start + i else
                    generate_block_hash_extra_keys(request, 0, hash_block_size)[0])
            triple = (parent or NONE_HASH, tokens[i:i + hash_block_size], keys)
            # sha256 (vLLM's default) written out as well: the same two C calls, one Python
            # call fewer per block.
            parent = (new_sha256(dumps(triple, protocol)).digest() if pickled_sha256
                      else caching_hash_fn(triple))
            new_hashes.append(parent)
        return new_hashes

    # The request reads this to skip the call while no block can have filled (most tokens).
    request_block_hasher.hash_block_size = hash_block_size
    return request_block_hasher


class BlockHashListWithBlockSize:
    """A request's hashes seen at a coarser block size.

    Hashes are computed every ``hash_block_size`` tokens and each covers its whole prefix, so a
    block of ``target_block_size`` (a multiple) is named by the hash at its last boundary: with
    hashes every 16 tokens ``[A, B, C, D]``, the 32-token blocks are ``[B, D]``. A view, not a
    copy: entries are read on access.
    """

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int,
                 target_block_size: int) -> None:
        if target_block_size % hash_block_size:
            raise ValueError(f"block size {target_block_size} is not a multiple of the hash "
                             f"block size {hash_block_size}")
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _get_value_at(self, idx: int) -> BlockHash:
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            return [self._get_value_at(i) for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self._get_value_at(idx)

    def __iter__(self) -> Iterator[BlockHash]:
        return (self._get_value_at(i) for i in range(len(self)))


BlockHashList = list[BlockHash] | BlockHashListWithBlockSize


def resolve_block_hashes(block_hashes: BlockHashList, hash_block_size: int,
                         block_size: int) -> BlockHashList:
    """``block_hashes`` as seen by a group of ``block_size`` tokens per block."""
    if block_size == hash_block_size or isinstance(block_hashes, BlockHashListWithBlockSize):
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


__all__ = [
    "BlockHash", "BlockHashList", "BlockHashListWithBlockSize", "BlockHashWithGroupId",
    "FreeKVCacheBlockQueue", "KVCacheBlock", "NONE_HASH",
    "generate_block_hash_extra_keys", "get_block_hash", "get_group_id",
    "get_request_block_hasher", "hash_block_tokens", "init_none_hash",
    "make_block_hash_with_group_id", "null_head_len", "resolve_block_hashes", "sha256",
    "sha256_cbor", "trim_null_head",
]
