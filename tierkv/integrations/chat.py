"""Greedy multi-turn chat over a transformers model, with and without tierkv reuse.

:class:`Conversation` keeps a chat as token ids that only ever grow (each prompt
extends the previous prompt and reply), which prefix reuse needs: re-tokenizing the
whole chat each turn could tokenize the old text differently and miss every page.
:func:`greedy` decodes with a given cache and counts, per forward call, the token
positions the model actually processed (:class:`TokenCounter`). :func:`run_chat` runs
each turn through :class:`~tierkv.integrations.hf.TierKVCache` (load the cached
prefix, compute the rest, save the new pages) and, to compare, twice more with plain
transformers caches: a ``DynamicCache`` kept in memory across turns and cut to the
prefix the store served (the same computation without the store, so the tokens must
match exactly in any dtype), and a fresh ``DynamicCache`` over the whole prompt (full
recompute: equal tokens in float32 here, while bfloat16 rounding can differ between one
long prefill and the same tokens computed in pieces). Used by ``tierkv demo`` and the
tests.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, Self

import torch

from tierkv.errors import InputError

if TYPE_CHECKING:  # transformers is imported only where a chat runs
    from tierkv.integrations.hf import TierKVCache


class ChatTokenizer(Protocol):
    """The parts of a transformers tokenizer a chat needs."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> str: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class TokenCounter:
    """Counts the token positions each forward call of ``model`` processes (``input_ids`` length).

    A context manager: the hook is installed on enter and removed on exit.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[int] = []
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    @property
    def tokens(self) -> int:
        return sum(self.calls)

    def _hook(self, module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise InputError("TokenCounter: a forward call without input_ids tensor (inputs_embeds are not counted)")
        self.calls.append(int(ids.shape[-1]))

    def __enter__(self) -> Self:
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


@dataclass(frozen=True)
class Decoded:
    """Generated ids (the stop token included if reached) and what the model processed.

    ``prefill_tokens`` were processed by the first forward call, ``processed_tokens``
    by all of them; times are wall seconds from the first call.
    """

    tokens: tuple[int, ...]
    prefill_tokens: int
    processed_tokens: int
    first_token_s: float
    total_s: float


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5.x names the argument ``cache``; earlier versions ``past_key_values``.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def greedy(model: torch.nn.Module, prompt: Sequence[int], cache: object, *, max_new_tokens: int,
           stop_ids: Sequence[int]) -> Decoded:
    """Greedy-decode after ``prompt``, whose first ``cache.get_seq_length()`` tokens ``cache`` holds.

    Processes the rest of the prompt in one call, then one token per call; stops after
    a token in ``stop_ids`` or ``max_new_tokens`` tokens. ``cache`` is updated in place.
    """
    start = int(cache.get_seq_length())  # type: ignore[attr-defined]
    if not 0 <= start < len(prompt):
        raise InputError(f"greedy: the cache holds {start} tokens of a {len(prompt)}-token prompt; "
                         "at least the last prompt token must be processed")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    kw = {_cache_kwarg(model): cache}
    out: list[int] = []
    first = 0.0
    x = torch.tensor([list(prompt[start:])], dtype=torch.long)
    with torch.no_grad(), TokenCounter(model) as counter:
        t0 = time.perf_counter()
        for step in range(max_new_tokens):
            logits = model(input_ids=x, use_cache=True, **kw).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            if step == 0:
                first = time.perf_counter() - t0
            if token in stop_ids:
                break
            x = torch.tensor([[token]], dtype=torch.long)
        total = time.perf_counter() - t0
    return Decoded(tuple(out), counter.calls[0], counter.tokens, first, total)


class Conversation:
    """A chat kept as growing token ids: every prompt extends the previous prompt and reply."""

    def __init__(self, tokenizer: ChatTokenizer, system: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.tokens: list[int] = []
        self._text = ""  # the chat-template text that self.tokens encode

    def prompt(self, user_text: str) -> list[int]:
        """Add a user message; returns the whole prompt's ids (the previous ones as its prefix)."""
        messages = [*self.messages, {"role": "user", "content": user_text}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not text.startswith(self._text):
            raise InputError("the chat template does not render the new turn as a continuation of the "
                             "previous text; the conversation's tokens cannot stay a prefix")
        self.tokens += self.tokenizer.encode(text[len(self._text):], add_special_tokens=False)
        self._text, self.messages = text, messages
        return list(self.tokens)

    def reply(self, token_ids: Sequence[int], stop_ids: Sequence[int]) -> str:
        """Add the assistant's generated ids (a trailing stop token is left to the template)."""
        ids = list(token_ids)
        if ids and ids[-1] in stop_ids:
            ids.pop()
        content = self.tokenizer.decode(ids)
        self.messages.append({"role": "assistant", "content": content})
        self.tokens += ids
        self._text += content
        return content


@dataclass(frozen=True)
class TurnReport:
    """One turn with reuse and, when compared, with full recompute (``recompute_*``).

    ``outputs_identical``: the same tokens as the full recompute; ``matches_plain_cache``:
    the same tokens as a plain ``DynamicCache`` kept in memory across turns, cut to the
    ``reused_tokens`` the store served.
    """

    turn: int
    prompt_tokens: int
    reused_tokens: int
    tokens_per_tier: dict[str, int]
    computed_tokens: int
    generated_tokens: int
    first_token_s: float
    reuse_s: float
    save_s: float
    pages_stored: int
    reply: str
    recompute_computed_tokens: int | None = None
    recompute_first_token_s: float | None = None
    recompute_s: float | None = None
    outputs_identical: bool | None = None
    matches_plain_cache: bool | None = None
    tokens: tuple[int, ...] = field(default=(), repr=False)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out.pop("tokens")
        return out


def stop_ids_of(tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """The ids that end an assistant turn (the tokenizer's EOS)."""
    if tokenizer.eos_token_id is None:
        raise InputError("the tokenizer has no EOS token; a chat turn would never end")
    return (int(tokenizer.eos_token_id),)


def run_chat(model: torch.nn.Module, tokenizer: ChatTokenizer, cache: TierKVCache, user_messages: Sequence[str],
             *, max_new_tokens: int = 32, compare: bool = True, system: str | None = None) -> list[TurnReport]:
    """Run a greedy multi-turn chat through ``cache``; with ``compare``, also with plain caches.

    The conversation continues with the reused run's reply.
    """
    from transformers import DynamicCache

    stop = stop_ids_of(tokenizer)
    conv = Conversation(tokenizer, system)
    plain = DynamicCache()
    reports: list[TurnReport] = []
    for turn, text in enumerate(user_messages, 1):
        prompt = conv.prompt(text)
        loaded = cache.load(prompt)
        dec = greedy(model, prompt, loaded.cache, max_new_tokens=max_new_tokens, stop_ids=stop)
        saved = cache.save(loaded.cache, prompt + list(dec.tokens))
        base = kept = None
        if compare:
            base = greedy(model, prompt, DynamicCache(), max_new_tokens=max_new_tokens, stop_ids=stop)
            extra = plain.get_seq_length() - loaded.tokens
            if extra > 0:
                plain.crop(-extra)  # negative: tokens to drop (transformers 4.56 and 5.x alike)
            kept = greedy(model, prompt, plain, max_new_tokens=max_new_tokens, stop_ids=stop)
            if kept.tokens != dec.tokens:  # the conversations diverge; restart the in-memory one
                plain = DynamicCache()
        reply = conv.reply(dec.tokens, stop)
        reports.append(TurnReport(
            turn=turn, prompt_tokens=len(prompt), reused_tokens=loaded.tokens,
            tokens_per_tier=dict(loaded.tokens_per_tier), computed_tokens=dec.prefill_tokens,
            generated_tokens=len(dec.tokens), first_token_s=loaded.seconds + dec.first_token_s,
            reuse_s=loaded.seconds + dec.total_s, save_s=saved.seconds, pages_stored=saved.pages_stored,
            reply=reply,
            recompute_computed_tokens=base.prefill_tokens if base else None,
            recompute_first_token_s=base.first_token_s if base else None,
            recompute_s=base.total_s if base else None,
            outputs_identical=(base.tokens == dec.tokens) if base else None,
            matches_plain_cache=(kept.tokens == dec.tokens) if kept else None, tokens=dec.tokens))
    return reports
