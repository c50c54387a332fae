"""Text to token ids and back, built from the GGUF file alone (no hub, no tokenizer.json).

SmolLM2 uses GPT-2-style byte-level BPE: text is split into pieces (words with their leading
space, runs of punctuation, single digits: SmolLM2's pre-tokenizer puts every digit on its own),
each piece's UTF-8 bytes are written as printable characters (byte ``0x20`` becomes ``Ġ``...),
and the merges, in order of priority, join characters into the vocabulary's tokens. The GGUF
carries the vocabulary (``tokenizer.ggml.tokens``), the merges (``tokenizer.ggml.merges``, "a b"
strings) and each token's type; type 3 (control) marks the special tokens (``<|im_start|>``,
``<|im_end|>``, ``<|endoftext|>``...), which are matched whole before BPE ever sees the text.

Decoding runs the other way without BPE: each token stands for a fixed string of bytes (its
characters mapped back through the byte-to-character table), so the text of a list of ids is
their bytes joined and read as UTF-8. ``decode`` looks the bytes up in a table made once, which
is several times faster than a call into ``tokenizers`` (an engine finishing 256 requests of 128
tokens at once decodes them in 2 to 3 ms instead of 13 to 15, on a 2-core CPU), and gives the
same text.

The chat template is the Jinja2 template the file carries (``tokenizer.chat_template``), rendered
as Hugging Face renders it.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from paged_attention.model.weights import gguf_metadata

CONTROL = 3   # llama.cpp's token type of a special (control) token


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level map, character to byte. The 188 bytes that print as themselves (``!``
    to ``~``, ``¡`` to ``¬``, ``®`` to ``ÿ``) are their own character; the other 68 (controls, the
    space, DEL, the no-break and soft hyphens...) take the characters from U+0100 on, in byte
    order: the space, byte 0x20, is the 33rd of them, ``Ġ`` (U+0120)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    shifted = sorted(set(range(256)) - set(printable))
    alphabet.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return alphabet


class Tokenizer:
    """A ``tokenizers`` byte-level BPE tokenizer with the GGUF's special tokens and chat template."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], *,
                 bos_token_id: int | None, eos_token_id: int | None, chat_template: str | None,
                 add_bos: bool = False, split_digits: bool = True) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        self.tokens = list(tokens)
        vocab = {token: i for i, token in enumerate(self.tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
        tok = HFTokenizer(bpe)
        pieces = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
        # GPT-2's split (contractions, letters, digits, other symbols, whitespace) and its byte-to-character map
        pieces.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(pieces)
        tok.decoder = decoders.ByteLevel()
        self.special_token_ids = {i for i, t in enumerate(token_types) if t == CONTROL}
        tok.add_special_tokens([AddedToken(self.tokens[i], special=True, normalized=False)
                                for i in sorted(self.special_token_ids)])
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, path: str | Path | None = None) -> "Tokenizer":
        """The tokenizer a GGUF file describes (default: the packaged SmolLM2)."""
        from paged_attention.model.weights import packaged_model_path

        meta = gguf_metadata(packaged_model_path() if path is None else path)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"only GPT-2-style byte-level BPE tokenizers are supported, the file has {model!r}")
        return cls(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.token_type"],
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   # llama.cpp's 'smollm' pre-tokenizer splits digits one by one, as SmolLM2's own does
                   split_digits=meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"))

    # ---- the vocabulary --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def stop_token_ids(self) -> set[int]:
        """Tokens that end a generation: the end-of-sequence token (``<|im_end|>`` for SmolLM2)
        and ``<|endoftext|>`` where the vocabulary has it."""
        stops = {self.eos_token_id} if self.eos_token_id is not None else set()
        end = self._tok.token_to_id("<|endoftext|>")
        if end is not None:
            stops.add(end)
        return stops

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) become one id each.
        A BOS token is prepended only when the file says so (SmolLM2's does not)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens are left out unless ``skip_special_tokens=False``.

        The ids' bytes joined, read as UTF-8; bytes that are not UTF-8 (a character cut between
        two tokens, say) read as U+FFFD, one per maximal ill-formed piece, as ``tokenizers`` reads
        them."""
        ids = list(ids)
        table = self._token_bytes[bool(skip_special_tokens)]
        try:
            # (This runs for every request an engine finishes: a table that is V long turns away
            # ids above the vocabulary by itself, and only negative ids need a look of their own.)
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")
        except IndexError:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})") from None
        except (TypeError, RuntimeError):                 # (RuntimeError: tensors compared as ids)
            raise TypeError(f"token ids must be ints, got {sorted({type(i).__name__ for i in ids})}") from None

    @cached_property
    def _token_bytes(self) -> tuple[list[bytes], list[bytes]]:
        """Each token's bytes, ``(with special tokens, special tokens as b"")``: a token's
        characters mapped back through the byte-level alphabet (a character outside it, in a
        special token, as its own UTF-8)."""
        char_bytes = {c: bytes([b]) for c, b in byte_level_alphabet().items()}
        every = [b"".join([char_bytes[c] if c in char_bytes else c.encode() for c in t]) for t in self.tokens]
        plain = [b"" if i in self.special_token_ids else b for i, b in enumerate(every)]
        return every, plain

    # ---- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (``[{"role": "user", "content": "..."}, ...]``).

        Rendered with the file's Jinja2 template, in a sandbox as Hugging Face does (a template is
        data from a file, not code to trust), with ``bos_token``/``eos_token`` defined for
        templates that use them.
        """
        if self.chat_template is None:
            raise ValueError("this GGUF file carries no chat template (tokenizer.chat_template)")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise TypeError("messages must be a list of {'role': str, 'content': str} dicts")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._name(self.bos_token_id), eos_token=self._name(self.eos_token_id))

    def _name(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokens[token_id]

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self._name(self.eos_token_id)!r})"


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """The Jinja2 template, compiled once per source (sandboxed; ``trim_blocks`` and ``lstrip_blocks``
    as Hugging Face sets them)."""
    if source not in _TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
