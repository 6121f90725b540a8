"""Tokenizing on the request path, for every transformers family.

`TextTokenizer` calls the `tokenizers` library's own `Tokenizer` (the backend of the
model's fast tokenizer) through `encode_batch_fast`, which releases the GIL. Each
backend copy is set up once at load (truncation, padding) and never changed after, so
any thread may call it. The transformers wrapper is not used here: every call re-sets
its backend's truncation and padding (two threads at once fail with "Already
borrowed"), and its Python costs about as much as tokenizing a short text does.

`off_loop` runs large tokenizing in a small shared thread pool, so one long text never
holds the event loop while the other requests wait (docs/bench/notes.md, Tokenizing).
The pool's threads tokenize one text at a time, so a large request takes at most
POOL_THREADS cores from the small ones, not every core.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from tokenizers import Encoding, Tokenizer

from ember.adapters.base import TokenSpan, usable_cores
from ember.errors import TRUNCATE_ADVICE, InputTooLong, InvalidInput

T = TypeVar("T")
EncodeInput = str | tuple[str, str]

# Tokenizing costs about 0.3 us a character and a hop to the pool about 50 us of CPU
# and latency; below this total the text is tokenized in place (at most ~0.7 ms).
OFFLOAD_CHARS = 2048
# Other request-path work (a score's similarities) estimated to take longer goes too.
OFFLOAD_US = 700.0
# Half the cores, at most 4: the rest stay for the event loop and the forwards.
POOL_THREADS = max(1, min(4, usable_cores() // 2))

_pool: ThreadPoolExecutor | None = None
_here = threading.local()


def _start_thread() -> None:
    _here.in_pool = True


def pool() -> ThreadPoolExecutor:
    """The process's tokenizing pool, started on first use (never before a fork)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="ember-tokenize",
                                   initializer=_start_thread)
    return _pool


def in_pool() -> bool:
    return bool(getattr(_here, "in_pool", False))


async def off_loop(chars: int, work: Callable[[], T]) -> T:
    """`work()`, in place for `chars` under OFFLOAD_CHARS, else in the tokenizing pool
    while the event loop serves the other requests."""
    return await off_loop_if(chars >= OFFLOAD_CHARS, work)


async def off_loop_if(long: bool, work: Callable[[], T]) -> T:
    """`work()` in the pool when it is `long`, else in place."""
    if not long:
        return work()
    return await asyncio.get_running_loop().run_in_executor(pool(), work)


def encode_batch(tokenizer: Tokenizer, inputs: list[EncodeInput],
                 add_special_tokens: bool = True) -> list[Encoding]:
    """One batch call, whose texts the library spreads over every core; in the pool, one
    call a text, which runs on the calling thread: a 1 MB request spread over both
    cores of a 2-core machine doubled the median of concurrent small requests."""
    if in_pool():
        return [tokenizer.encode_batch_fast([one], add_special_tokens=add_special_tokens)[0]
                for one in inputs]
    return tokenizer.encode_batch_fast(inputs, add_special_tokens=add_special_tokens)


def id_rows(encodings: Sequence[Encoding],
            field: str = "ids") -> list[npt.NDArray[np.int32]]:
    """Each encoding's ids (or its `type_ids`, `special_tokens_mask`) as a view of one
    int32 block. A 2,048-text request then holds one buffer and 2,048 small views, not
    2,048 lists of Python ints: those filled the heap's arenas, and what outlived the
    request kept them (docs/bench/notes.md, "Resident memory after abandoned bulk
    requests")."""
    values = operator.attrgetter(field)
    if len(encodings) == 1:  # the lone text of most requests: no block to cut (2 us less)
        return [np.array(values(encodings[0]), np.int32)]
    return cut(np.fromiter(itertools.chain.from_iterable(map(values, encodings)),
                           dtype=np.int32, count=sum(map(len, encodings))),
               [len(encoding) for encoding in encodings])


def cut(block: npt.NDArray[np.int32], lengths: Sequence[int]) -> list[npt.NDArray[np.int32]]:
    """`block` as consecutive views of `lengths`."""
    bounds = list(itertools.accumulate(lengths, initial=0))
    return [block[start:stop] for start, stop in itertools.pairwise(bounds)]


def first_outside(row: Sequence[int], vocabulary: int) -> int | None:
    """The index of the first id outside [0, vocabulary), checked in numpy: a request may
    carry millions of ids, and the event loop must not walk them one by one."""
    try:
        ids = np.asarray(row, dtype=np.int64)
    except OverflowError:  # an id past int64 is outside any vocabulary; find it the slow way
        return next(i for i, token in enumerate(row) if not 0 <= token < vocabulary)
    outside = np.flatnonzero((ids < 0) | (ids >= vocabulary))
    return int(outside[0]) if outside.size else None


def first_outside_rows(rows: Sequence[Sequence[int]],
                       vocabulary: int) -> tuple[int, int] | None:
    """(row, index) of the first id outside [0, vocabulary), row by row."""
    for row_index, row in enumerate(rows):
        index = first_outside(row, vocabulary)
        if index is not None:
            return row_index, index
    return None


def over_limit(count: int, limit: int, param: str, what: str = "") -> InputTooLong:
    """`what` says which part of a longer sequence (a pair's query) the count is of."""
    return InputTooLong(f"{count} tokens{what} exceeds max_seq_length {limit}; shorten the "
                        f"text or {TRUNCATE_ADVICE}", param)


# Tokens left past where a pair's cut can reach when a long first text is cut before
# pairing: the words at the new edge may tokenize otherwise, far from what is kept.
PAIR_MARGIN = 64


class TextTokenizer:
    """A fast tokenizer's backend, copied and configured once per truncation strategy:
    none, or `longest_first` (one text, or a pair cut from the longer side, as
    sentence-transformers and TEI cut a reranker's pair); it cuts to `limit` tokens,
    special tokens included, from the wrapper's `truncation_side`, as the transformers
    wrapper would."""

    def __init__(self, wrapper: Any, limit: int) -> None:
        source: str = wrapper.backend_tokenizer.to_str()
        self.limit = limit
        self.token_types = "token_type_ids" in wrapper.model_input_names

        def copy(strategy: str | None) -> Tokenizer:
            tokenizer = Tokenizer.from_str(source)
            tokenizer.no_padding()  # a tokenizer.json may carry padding; rows stay unpadded
            if strategy is None:
                tokenizer.no_truncation()
            else:
                tokenizer.enable_truncation(limit, stride=0, strategy=strategy,
                                            direction=wrapper.truncation_side)
            tokenizer.encode_special_tokens = bool(wrapper.split_special_tokens)
            return tokenizer

        self._whole = copy(None)
        self._cut = copy("longest_first")
        self.side: str = wrapper.truncation_side
        self.pair_specials = self._whole.num_special_tokens_to_add(is_pair=True)
        self.head, self.tail = self._frame()

    def encode(self, texts: Sequence[str], truncate: bool,
               where: Sequence[str]) -> list[Encoding]:
        """All texts in one batch call; over-long texts are cut to the limit or refused
        (`where` names each text for the error)."""
        tokenizer = self._cut if truncate else self._whole
        encodings = encode_batch(tokenizer, list(texts))
        for encoding, param in zip(encodings, where, strict=True):
            if len(encoding) > self.limit:
                raise over_limit(len(encoding), self.limit, param)
        return encodings

    def count(self, text: str) -> int:
        """Tokens of one text without special tokens or truncation."""
        return len(encode_batch(self._whole, [text], add_special_tokens=False)[0])

    def spans(self, read: str, special: bool, text: str,
              origin: Sequence[int] | None = None) -> list[TokenSpan]:
        """The tokens of `read` (`text` as the tokenizer is given it), whole, each with its
        slice of `text` and that slice's place in its UTF-8 bytes. `origin` maps a place
        in `read` to one in `text` where their lengths differ (a lowered "İ" is two)."""
        # Not encode_batch_fast: it leaves the offsets out.
        encoding = self._whole.encode(read, add_special_tokens=special)
        at = None if text.isascii() else list(itertools.accumulate(
            (len(c.encode("utf-8", "surrogatepass")) for c in text), initial=0))
        spans: list[TokenSpan] = []
        for id, (start, stop), mask, token in zip(encoding.ids, encoding.offsets,
                                                  encoding.special_tokens_mask,
                                                  encoding.tokens, strict=True):
            if mask:
                spans.append({"id": id, "text": token, "special": True, "start": None,
                              "stop": None})
                continue
            if origin is not None:
                start, stop = origin[start], origin[stop]
            spans.append({"id": id, "text": text[start:stop], "special": False,
                          "start": at[start] if at else start,
                          "stop": at[stop] if at else stop})
        return spans

    def decode(self, rows: Sequence[Sequence[int]], skip_special: bool,
               field: str) -> list[str]:
        """The text of each row of token ids; an id outside the vocabulary is a 422
        naming its place (`{field}[row][i]`)."""
        vocabulary = self._whole.get_vocab_size(with_added_tokens=True)
        if (outside := first_outside_rows(rows, vocabulary)) is not None:
            row, index = outside
            raise InvalidInput(f"token id {rows[row][index]} is outside the model's "
                               f"vocabulary (ids 0 to {vocabulary - 1})",
                               f"{field}[{row}][{index}]")
        return self._whole.decode_batch([list(row) for row in rows],
                                        skip_special_tokens=skip_special)

    def encode_pairs(self, first: str, seconds: Sequence[str], truncate: bool,
                     first_tokens: int | None = None) -> list[Encoding]:
        """(first, second) pairs in one batch call, cut from the longer side or whole;
        `first_tokens` is `count(first)`, where the caller has it."""
        if not truncate:
            return encode_batch(self._whole, [(first, second) for second in seconds])
        if first_tokens is None:
            first_tokens = self.count(first)
        if first_tokens <= self.limit + PAIR_MARGIN:  # the pairs' own cut is cheap
            return encode_batch(self._cut, [(first, second) for second in seconds])
        return encode_batch(self._cut, list(zip(self._firsts(first, seconds), seconds,
                                                strict=True)))

    def _firsts(self, first: str, seconds: Sequence[str]) -> list[str]:
        """`first` as each pair needs it: a long one (a query) would be tokenized whole
        again with every second text, so it is cut where the cut never reaches. A pair
        keeps fewer of its tokens than the limit, and longest_first weighs only the two
        lengths: cut PAIR_MARGIN tokens past the limit and the second text's length, it
        keeps the same tokens and stays the longer side."""
        # With its offsets; the batch call lets go of the GIL (`encode` held the event
        # loop for as long as a 1 MB query took).
        encoding = self._whole.encode_batch([first], add_special_tokens=False)[0]
        count = len(encoding)
        lengths = map(len, encode_batch(self._whole, list(seconds), add_special_tokens=False))
        cuts: dict[int, str] = {}
        firsts = []
        for length in lengths:
            keep = max(self.limit, length) + PAIR_MARGIN
            if keep >= count:
                firsts.append(first)
                continue
            if keep not in cuts:  # at a token's edge; the side the tokenizer cuts from goes
                cuts[keep] = (first[encoding.offsets[count - keep][0]:] if self.side == "left"
                              else first[:encoding.offsets[keep][0]])
            firsts.append(cuts[keep])
        return firsts

    def _frame(self) -> tuple[list[int], list[int]]:
        """The special tokens the template puts before and after a text's ids (BERT:
        [CLS] and [SEP]), found by encoding one word with and without them."""
        bare = self._whole.encode_batch_fast(["a"], add_special_tokens=False)[0].ids
        framed = self._whole.encode_batch_fast(["a"])[0].ids
        for start in range(len(framed) - len(bare) + 1):
            if framed[start:start + len(bare)] == bare:
                return framed[:start], framed[start + len(bare):]
        return [], []

    def wrap_ids(self, rows: Sequence[Sequence[int]], truncate: bool,
                 field: str) -> list[list[int]]:
        """Token-id rows as the tokenizer would have made them from text: the template's
        special tokens around the ids (kept as they are when a row already has them),
        cut to the limit or refused."""
        head, tail = self.head, self.tail
        room = self.limit - len(head) - len(tail)
        out = []
        for index, row in enumerate(rows):
            ids = [int(token) for token in row]
            if (head or tail) and ids[:len(head)] == head \
                    and ids[len(ids) - len(tail):] == tail \
                    and len(ids) >= len(head) + len(tail):
                ids = ids[len(head):len(ids) - len(tail)]
            if len(ids) > room:
                if not truncate:
                    raise over_limit(len(ids) + len(head) + len(tail), self.limit,
                                     f"{field}[{index}]")
                ids = ids[:room]
            out.append([*head, *ids, *tail])
        return out
