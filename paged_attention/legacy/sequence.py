"""The little of vLLM's ``sequence.py`` that the legacy block manager reads.

A ``Sequence`` is one stream of tokens (a prompt and what has been generated after it); a
``SequenceGroup`` is the sequences of one request (several for parallel sampling or beam
search, plus an encoder prompt for encoder/decoder models). The block manager only looks at
their token ids, their status, how many tokens have been computed, and their LoRA id (which
changes the prefix-cache hash).
"""
from __future__ import annotations

import enum
import math
from typing import Optional

from paged_attention.legacy.common import check_token_ids
from paged_attention.utils import check_int, is_int


class SequenceStatus(enum.IntEnum):
    """Where a sequence is in its life. Values above ``SWAPPED`` mean finished."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        return status > SequenceStatus.SWAPPED


class SequenceData:
    """A sequence's tokens and how many of them the model has computed (their KV is cached).

    The tokens are kept in one list (prompt, then output), so ``get_token_ids`` costs nothing:
    the block manager asks for it at every step. Treat the returned list as read-only.
    """

    def __init__(self, prompt_token_ids: list[int], output_token_ids: Optional[list[int]] = None):
        prompt_token_ids = check_token_ids("prompt_token_ids", prompt_token_ids)
        output_token_ids = [] if output_token_ids is None else check_token_ids("output_token_ids", output_token_ids)
        self._token_ids = list(prompt_token_ids) + list(output_token_ids)
        self._prompt_len = len(prompt_token_ids)
        self._num_computed_tokens = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._token_ids[:self._prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._prompt_len:]

    def append_token_id(self, token_id: int) -> None:
        if type(token_id) is not int:             # a plain int is the common case
            if not is_int(token_id):
                raise TypeError(f"token_id must be an int, got {token_id!r}")
            token_id = int(token_id)
        self._token_ids.append(token_id)

    def get_len(self) -> int:
        return len(self._token_ids)

    def get_prompt_len(self) -> int:
        return self._prompt_len

    def get_token_ids(self) -> list[int]:
        return self._token_ids

    def get_num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        """``num_new_computed_tokens`` more tokens have been computed (an increment)."""
        if type(num_new_computed_tokens) is not int and not is_int(num_new_computed_tokens):
            raise TypeError(f"num_new_computed_tokens must be an int, got {num_new_computed_tokens!r}")
        if num_new_computed_tokens < 0 or self._num_computed_tokens + num_new_computed_tokens > len(self._token_ids):
            raise ValueError(f"cannot compute {num_new_computed_tokens} more tokens: {self._num_computed_tokens} "
                             f"of {len(self._token_ids)} are computed")
        self._num_computed_tokens += num_new_computed_tokens

    def reset_state_for_recompute(self) -> None:
        """After a preemption by recomputation: nothing is computed any more."""
        self._num_computed_tokens = 0


class Sequence:
    """One sequence of tokens. It starts ``WAITING``; the scheduler moves it along."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], block_size: int, lora_int_id: int = 0):
        self.seq_id = check_int("seq_id", seq_id, 0)
        self.block_size = check_int("block_size", block_size, 1)
        self.lora_int_id = check_int("lora_int_id", lora_int_id, 0)
        self.data = SequenceData(prompt_token_ids)
        self.status = SequenceStatus.WAITING

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def append_token_id(self, token_id: int, logprobs: Optional[dict] = None) -> None:
        """A token generated for this sequence (``logprobs`` is accepted and ignored); an int."""
        self.data.append_token_id(token_id)

    def is_prefill(self) -> bool:
        """True while part of the prompt is still to be computed; generated tokens never make
        it a prefill again."""
        return self.data.get_num_computed_tokens() < self.data.get_prompt_len()

    def is_finished(self) -> bool:
        return SequenceStatus.is_finished(self.status)

    def extra_hash(self) -> Optional[int]:
        """What besides the tokens names this sequence's KV in the prefix cache: its LoRA
        adapter (None without one)."""
        return None if self.lora_int_id == 0 else hash(self.lora_int_id)

    def __repr__(self) -> str:
        return f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_tokens={self.get_len()})"


class SequenceGroup:
    """The sequences of one request, and for encoder/decoder models its encoder sequence."""

    def __init__(self, request_id: str, seqs: list[Sequence], arrival_time: float = 0.0,
                 encoder_seq: Optional[Sequence] = None):
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if not isinstance(seqs, (list, tuple)):
            raise TypeError(f"seqs must be a list of Sequences, got {type(seqs).__name__}")
        if not seqs:
            raise ValueError("a sequence group needs at least one sequence")
        for seq in seqs:
            if not isinstance(seq, Sequence):
                raise TypeError(f"seqs must hold Sequences only, got {type(seq).__name__}")
        if len({seq.seq_id for seq in seqs}) != len(seqs):
            raise ValueError(f"seqs must have distinct seq_ids, got {[seq.seq_id for seq in seqs]}")
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)):
            raise TypeError(f"arrival_time must be a real number, got {arrival_time!r}")
        if math.isnan(arrival_time):
            raise ValueError("arrival_time must not be NaN")
        if encoder_seq is not None and not isinstance(encoder_seq, Sequence):
            raise TypeError(f"encoder_seq must be a Sequence or None, got {type(encoder_seq).__name__}")
        self.request_id = request_id
        self.seqs = list(seqs)
        self.arrival_time = arrival_time
        self.encoder_seq = encoder_seq

    def get_seqs(self, status: Optional[SequenceStatus] = None) -> list[Sequence]:
        if status is None:
            return self.seqs
        if not isinstance(status, SequenceStatus):
            raise TypeError(f"status must be a SequenceStatus or None, got {status!r}")
        return [seq for seq in self.seqs if seq.status == status]

    def is_encoder_decoder(self) -> bool:
        return self.encoder_seq is not None

    def get_encoder_seq(self) -> Optional[Sequence]:
        return self.encoder_seq

    def num_seqs(self, status: Optional[SequenceStatus] = None) -> int:
        return len(self.get_seqs(status))

    def is_finished(self) -> bool:
        return all(seq.is_finished() for seq in self.seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, num_seqs={len(self.seqs)})"
