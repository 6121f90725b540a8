"""cohere's ClientV2 (rerank and embed) and huggingface_hub's InferenceClient
(feature_extraction and sentence_similarity, which post TEI bodies to the server's root)
against a live Ember, with the libraries' defaults."""

from __future__ import annotations

import cohere
import numpy as np
import pytest
from huggingface_hub import InferenceClient

from tests.clients.conftest import MINILM, PROMPTED, cosine, native_vectors
from tests.live_server import ServerProcess

QUERY = "what is the capital of France?"
DOCS = ["Berlin is the capital of Germany.", "Paris is the capital of France.",
        "Bananas are rich in potassium."]


@pytest.fixture(scope="module")
def co(server: ServerProcess) -> cohere.ClientV2:
    return cohere.ClientV2(api_key="unused", base_url=server.url)


def test_cohere_rerank(co: cohere.ClientV2) -> None:
    response = co.rerank(model=MINILM, query=QUERY, documents=DOCS, top_n=2)
    assert [r.index for r in response.results] == [1, 0]
    assert response.results[0].relevance_score > response.results[1].relevance_score


def test_cohere_embed_every_type(co: cohere.ClientV2, server: ServerProcess) -> None:
    response = co.embed(model=MINILM, texts=DOCS, input_type="search_document",
                        embedding_types=["float", "int8", "uint8", "binary", "ubinary"])
    reference = native_vectors(server, MINILM, DOCS)
    floats = response.embeddings.float_
    assert floats is not None
    for got, want in zip(floats, reference, strict=True):
        assert cosine(got, want) > 0.9999
    int8 = np.array(response.embeddings.int8)
    assert int8.shape == (3, 384) and int8.min() >= -127 and int8.max() <= 127
    assert cosine(int8[1], reference[1]) > 0.99
    uint8 = np.array(response.embeddings.uint8)
    np.testing.assert_array_equal(uint8 - 128, int8)
    ubinary = np.array(response.embeddings.ubinary, dtype=np.uint8)
    np.testing.assert_array_equal(ubinary, np.packbits(reference > 0, axis=-1))
    np.testing.assert_array_equal(np.array(response.embeddings.binary), ubinary.astype(int) - 128)


def unit_prefixes(vectors: np.ndarray, dims: int) -> np.ndarray:
    """What a Matryoshka cut returns for normalized vectors: the first `dims`, unit again."""
    cut = np.asarray(vectors)[:, :dims]
    return cut / np.linalg.norm(cut, axis=1, keepdims=True)


def test_cohere_output_dimension_cuts_every_type(co: cohere.ClientV2,
                                                 server: ServerProcess) -> None:
    response = co.embed(model=MINILM, texts=DOCS, input_type="search_document",
                        embedding_types=["float", "int8", "ubinary"], output_dimension=128)
    want = unit_prefixes(native_vectors(server, MINILM, DOCS), 128)
    np.testing.assert_allclose(np.array(response.embeddings.float_), want, atol=1e-5)
    int8 = np.array(response.embeddings.int8)
    assert int8.shape == (3, 128) and cosine(int8[1], want[1]) > 0.99
    ubinary = np.array(response.embeddings.ubinary, dtype=np.uint8)
    np.testing.assert_array_equal(ubinary, np.packbits(want > 0, axis=-1))


def test_cohere_int8_dot_products_rank_as_the_floats(co: cohere.ClientV2) -> None:
    """Found by a black-box review: each vector had its own scale, which Cohere's shape
    cannot carry, so int8 dot products (how a vector store compares them) ranked the
    documents otherwise than the floats: 8 of the top 10 in common."""
    from scipy.stats import spearmanr

    words = ["cats", "dogs", "cars", "stocks", "rain", "love", "hate", "sell", "watch", "fish",
             "music", "money", "snow"]
    docs = [f"{words[i % 4]} {words[4 + i % 4]} {words[8 + (i // 4) % 5]}" for i in range(80)]
    query = "animals that like to eat fish"
    doc_types = co.embed(model=MINILM, texts=docs, input_type="search_document",
                         embedding_types=["float", "int8", "uint8"]).embeddings
    query_types = co.embed(model=MINILM, texts=[query], input_type="search_query",
                           embedding_types=["float", "int8", "uint8"]).embeddings
    floats = np.array(doc_types.float_) @ np.array(query_types.float_)[0]
    codes = np.array(doc_types.int8, dtype=np.int64) @ np.array(query_types.int8)[0]
    top = set(np.argsort(-floats)[:10].tolist())
    assert len(top & set(np.argsort(-codes)[:10].tolist())) >= 9
    assert spearmanr(floats, codes).correlation > 0.995
    # uint8 is the same codes shifted, one scale a model: norms stay alike.
    unsigned = np.array(doc_types.uint8, dtype=np.int64) - 128
    np.testing.assert_array_equal(unsigned, np.array(doc_types.int8))
    norms = np.linalg.norm(np.array(doc_types.int8, dtype=float), axis=1)
    assert norms.max() / norms.min() < 1.1


def test_cohere_search_query_is_the_query_side(co: cohere.ClientV2,
                                               server: ServerProcess) -> None:
    query = co.embed(model=PROMPTED, texts=[QUERY], input_type="search_query",
                     embedding_types=["float"]).embeddings.float_
    document = co.embed(model=PROMPTED, texts=[QUERY], input_type="search_document",
                        embedding_types=["float"]).embeddings.float_
    assert query is not None and document is not None
    expected = native_vectors(server, PROMPTED, [QUERY], is_query=True)[0]
    assert cosine(query[0], expected) > 0.9999
    assert cosine(document[0], expected) < 0.99


def test_cohere_v1_client_embeds_and_reranks(server: ServerProcess) -> None:
    """Found by a black-box review: cohere.Client's embed got a bare 404, and its rerank's
    answer no id or meta."""
    v1 = cohere.Client(api_key="unused", base_url=server.url)
    floats = v1.embed(texts=DOCS, input_type="search_document")  # the default model
    assert floats.response_type == "embeddings_floats"
    np.testing.assert_allclose(floats.embeddings, native_vectors(server, MINILM, DOCS),
                               atol=1e-6)
    typed = v1.embed(model=MINILM, texts=DOCS[:1], embedding_types=["int8", "float"])
    assert typed.response_type == "embeddings_by_type" and typed.meta is not None
    assert typed.embeddings.float_ == floats.embeddings[:1]
    assert typed.meta.api_version is not None and typed.meta.api_version.version == "1"
    ranked = v1.rerank(model=MINILM, query=QUERY, top_n=1, return_documents=True,
                       documents=[{"text": d, "title": f"doc {i}"} for i, d in enumerate(DOCS)])
    assert ranked.id and ranked.meta is not None
    [best] = ranked.results
    assert best.index == 1 and best.document is not None and best.document.text == DOCS[1]


def test_cohere_refuses_what_it_cannot_honour(co: cohere.ClientV2) -> None:
    with pytest.raises(cohere.UnprocessableEntityError) as caught:
        co.embed(model=MINILM, texts=DOCS, input_type="search_document",
                 embedding_types=["float"], truncate="START")
    assert "truncate" in str(caught.value.body)


@pytest.fixture
def hf(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> InferenceClient:
    """The suite runs with HF_HUB_OFFLINE=1 so no model is ever fetched; huggingface_hub
    then refuses every request, loopback included. This client only talks to Ember."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return InferenceClient(base_url=server.url)


def test_huggingface_hub_feature_extraction(hf: InferenceClient,
                                            server: ServerProcess) -> None:
    got = hf.feature_extraction(DOCS[1])
    assert cosine(np.asarray(got).reshape(-1), native_vectors(server, MINILM, [DOCS[1]])[0]) \
        > 0.9999


def test_huggingface_hub_sentence_similarity(hf: InferenceClient,
                                             server: ServerProcess) -> None:
    got = hf.sentence_similarity(QUERY, other_sentences=DOCS)
    reference = native_vectors(server, MINILM, [QUERY, *DOCS])
    expected = [cosine(reference[0], doc) for doc in reference[1:]]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert int(np.argmax(got)) == 1


def test_huggingface_hub_dimensions_with_and_without_normalizing(
        hf: InferenceClient, server: ServerProcess) -> None:
    whole = native_vectors(server, MINILM, DOCS[:2])
    cut = hf.feature_extraction(DOCS[:2], dimensions=64)
    np.testing.assert_allclose(cut, unit_prefixes(whole, 64), atol=1e-5)
    raw = hf.feature_extraction(DOCS[:2], dimensions=64, normalize=False)
    raw_whole = hf.feature_extraction(DOCS[:2], normalize=False)
    np.testing.assert_allclose(raw, np.asarray(raw_whole)[:, :64], atol=1e-6)
    assert abs(float(np.linalg.norm(raw[0])) - 1.0) > 0.01  # not made unit
