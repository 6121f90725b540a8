"""The shared tokenizing (`_tokenize`): the same ids, masks and truncation as the
transformers wrapper, safe from many threads at once, and large inputs off the event loop
while small ones stay on it."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ember.adapters import transformer
from ember.adapters._tokenize import OFFLOAD_CHARS, TextTokenizer, in_pool, off_loop
from ember.adapters._torch import load_tokenizer
from ember.adapters.base import EncodeOptions, Runtime, ScoreOptions
from ember.adapters.transformer import TransformerAdapter
from ember.config import DEFAULT_MODEL, load_catalog, resolve_source
from ember.engine.types import PreparedItem
from ember.errors import InvalidInput
from tests.adapters.serving import ServeFactory

LIMIT = 24  # small, so that truncation happens often
WORDS = ["the", "capital", "of", "France", "is", "Paris", ",", "où", "les", "cafés",
         "ferment", "tard", "!", "naïve", "résumé", "tokenizers", "don't", "split", "[CLS]",
         "or", "[SEP]", "inside", "text", "東京", "1234567", "e-mail"]


def texts(count: int, seed: int = 3) -> list[str]:
    """Texts from 0 to ~60 words, some past LIMIT tokens, with accents, CJK, punctuation
    and special-token strings inside."""
    rng = random.Random(seed)
    return ["", " ", *(" ".join(rng.choices(WORDS, k=rng.randint(1, 60)))
                      for _ in range(count))]


@pytest.fixture(scope="module")
def minilm_wrapper() -> Any:
    spec = load_catalog()[DEFAULT_MODEL]
    return load_tokenizer(spec, resolve_source(spec))


@pytest.fixture(scope="module")
def bpe_wrapper(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level BPE tokenizer (RoBERTa's template) cutting from the left: the other
    kind of fast tokenizer than MiniLM's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(200, seed=9), trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    folder = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        truncation_side="left").save_pretrained(str(folder))
    wrapper = PreTrainedTokenizerFast.from_pretrained(str(folder))  # type: ignore[no-untyped-call]
    assert wrapper.truncation_side == "left"
    return wrapper


@pytest.fixture(params=["minilm", "bpe"])
def wrapper(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_wrapper")


def test_single_texts_match_the_transformers_wrapper(wrapper: Any) -> None:
    tokens = TextTokenizer(wrapper, LIMIT)
    batch = texts(40)
    where = [f"items[{i}].text" for i in range(len(batch))]
    cut = tokens.encode(batch, True, where)
    expected = wrapper(batch, truncation=True, max_length=LIMIT,
                       return_special_tokens_mask=True, verbose=False)
    assert [e.ids for e in cut] == expected["input_ids"]
    assert [e.special_tokens_mask for e in cut] == expected["special_tokens_mask"]
    assert max(len(e) for e in cut) == LIMIT
    whole = [t for t in batch if len(wrapper(t, verbose=False)["input_ids"]) <= LIMIT]
    assert [e.ids for e in tokens.encode(whole, False, ["x"] * len(whole))] == \
        wrapper(whole, verbose=False)["input_ids"]


def test_an_over_long_text_is_refused_by_name(wrapper: Any) -> None:
    tokens = TextTokenizer(wrapper, LIMIT)
    long = " ".join(WORDS * 3)
    with pytest.raises(InvalidInput) as caught:
        tokens.encode(["short", long], False, ["items[0].text", "items[1].text"])
    assert caught.value.param == "items[1].text"
    assert f"{len(wrapper(long)['input_ids'])} tokens exceeds max_seq_length {LIMIT}" \
        in str(caught.value)


@pytest.mark.parametrize("truncate", [True, False])
def test_pairs_match_the_transformers_wrapper(minilm_wrapper: Any, truncate: bool) -> None:
    tokens = TextTokenizer(minilm_wrapper, LIMIT)
    assert tokens.token_types and tokens.pair_specials == 3
    query, docs = "what is the capital of France ?", [t for t in texts(30) if t.strip()]
    got = tokens.encode_pairs(query, docs, truncate, tokens.count(query))
    expected = minilm_wrapper([query] * len(docs), docs,
                              truncation="longest_first" if truncate else False,
                              max_length=LIMIT if truncate else None, verbose=False)
    assert [e.ids for e in got] == expected["input_ids"]
    assert [e.type_ids for e in got] == expected["token_type_ids"]
    assert tokens.count(query) == len(minilm_wrapper(query, add_special_tokens=False)
                                      ["input_ids"])


def test_token_ids_get_the_templates_special_tokens(minilm_wrapper: Any) -> None:
    tokens = TextTokenizer(minilm_wrapper, LIMIT)
    ids = minilm_wrapper("a cat sleeps", add_special_tokens=False)["input_ids"]
    framed = minilm_wrapper("a cat sleeps")["input_ids"]
    assert tokens.wrap_ids([ids, framed], True, "input") == [framed, framed]
    assert len(tokens.wrap_ids([list(range(1000, 1100))], True, "input")[0]) == LIMIT


def test_many_threads_tokenize_as_one_does(minilm_wrapper: Any) -> None:
    """Both truncation settings from 8 threads at once give the sequential ids: nothing
    is re-set per call (the wrapper re-sets its backend on every call)."""
    tokens = TextTokenizer(minilm_wrapper, LIMIT)
    batches = [texts(8, seed=s) for s in range(64)]
    where = ["x"] * 10

    def run(index: int) -> list[list[int]]:
        batch, truncate = batches[index], index % 2 == 0
        if not truncate:  # only those that fit, as an untruncated request would hold
            batch = [t for t in batch if len(tokens.encode([t], True, ["x"])[0]) < LIMIT]
        return [e.ids for e in tokens.encode(batch, truncate, where[:len(batch)])]

    sequential = [run(i) for i in range(len(batches))]
    with ThreadPoolExecutor(8) as threads:
        for _ in range(5):
            assert list(threads.map(run, range(len(batches)))) == sequential


async def test_the_pool_takes_only_large_inputs() -> None:
    assert not await off_loop(OFFLOAD_CHARS - 1, in_pool)
    assert await off_loop(OFFLOAD_CHARS, in_pool)
    assert not in_pool()  # the loop's own thread


@pytest.fixture(scope="module")
def minilm() -> Iterator[TransformerAdapter]:
    adapter = transformer.load(load_catalog()[DEFAULT_MODEL], Runtime(backend="torch"))
    yield adapter
    adapter.close()


def recording(adapter: TransformerAdapter, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of the adapter's tokenize ran in the pool."""
    calls: list[bool] = []
    real = adapter.tokenize

    def tokenize(texts: Sequence[str], truncate: bool, where: Sequence[str],
                 queries: int = 0) -> list[PreparedItem]:
        calls.append(in_pool())
        return real(texts, truncate, where, queries)

    monkeypatch.setattr(adapter, "tokenize", tokenize)
    return calls


async def test_an_adapter_tokenizes_large_requests_in_the_pool(
        minilm: TransformerAdapter, serve: ServeFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = recording(minilm, monkeypatch)
    small, large = "a cat sleeps", "word " * (OFFLOAD_CHARS // 5 + 1)
    async with serve(minilm) as served:
        await minilm.encode(served.submit, [small], EncodeOptions())
        await minilm.encode(served.submit, [large], EncodeOptions())
        await minilm.encode(served.submit, [small] * 200, EncodeOptions())  # 2,400 chars
        await minilm.score(served.submit, small, [large], ScoreOptions())
    assert calls == [False, True, True, True]


async def test_the_loop_keeps_serving_while_a_1mb_request_is_tokenized(
        minilm: TransformerAdapter, serve: ServeFactory) -> None:
    rng = random.Random(5)
    large = [" ".join(rng.choices(WORDS, k=30_000))[:200_000] for _ in range(5)]
    started = time.perf_counter()
    minilm.prepare(large, EncodeOptions())
    tokenize_s = time.perf_counter() - started  # what the loop would stall for in place
    gaps: list[float] = []
    done = threading.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with serve(minilm) as served:
        ticks = asyncio.ensure_future(ticker())
        out = await minilm.encode(served.submit, large, EncodeOptions())
        done.set()
        await ticks
    assert out.tokens == 5 * minilm.max_seq_length
    assert max(gaps) < tokenize_s / 2, (max(gaps), tokenize_s)


def test_a_backend_set_to_pad_leaves_rows_unpadded(bpe_wrapper: Any) -> None:
    """A tokenizer.json may carry padding; the copies never pad."""
    bpe_wrapper.backend_tokenizer.enable_padding(pad_id=1, pad_token="<pad>", length=40)
    tokens = TextTokenizer(bpe_wrapper, 64)
    assert [len(e) for e in tokens.encode(["a", "the cat"], True, ["x", "y"])] == \
        [len(bpe_wrapper(t)["input_ids"]) for t in ("a", "the cat")]
    assert max(len(bpe_wrapper(t)["input_ids"]) for t in ("a", "the cat")) < 40
