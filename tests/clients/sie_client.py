"""Driven by test_sie_sdk.py in a Python 3.12 environment with sie-sdk 0.10.1: every call
the SDK offers for encode, score and extract, run unchanged against a live Ember, with
what came back written as JSON for the test to judge.

    python sie_client.py BASE_URL OUT.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from sie_sdk import SIEClient
from sie_sdk.client.errors import RequestError

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
PROMPTED = "test/minilm-prompts"
SPACY = "spacy/en_core_web_sm"
M3 = "test/tiny-m3"
QUERY = "how do plants make food"
DOCS = ["Photosynthesis turns light into sugar.", "The stock market fell today."]


def refusal(call: Any) -> dict[str, Any]:
    """How the SDK surfaced an error: its typed class, status, code and param."""
    try:
        call()
    except RequestError as exc:
        return {"class": type(exc).__name__, "status": exc.status_code, "code": exc.code,
                "param": exc.param, "message": str(exc)}
    return {"class": None}


def main(url: str, out: str) -> None:
    report: dict[str, Any] = {}
    with SIEClient(url, timeout_s=120) as client:
        query = client.encode(PROMPTED, {"text": QUERY}, is_query=True)
        document = client.encode(PROMPTED, {"text": QUERY})
        report["query_vector"] = query["dense"].tolist()
        report["document_vector"] = document["dense"].tolist()
        report["request_id"] = query.get("request", {}).get("id")

        batch = client.encode(MINILM, [{"id": "a", "text": DOCS[0]}, {"text": DOCS[1]}],
                              output_types=["dense"], options={"normalize": True})
        report["batch_ids"] = [item.get("id") for item in batch]
        report["batch_vectors"] = [item["dense"].tolist() for item in batch]
        report["dtypes"] = {}
        for dtype in ("float32", "float16", "int8", "uint8", "binary", "ubinary"):
            encoded = client.encode(MINILM, {"text": DOCS[0]}, output_dtype=dtype)
            report["dtypes"][dtype] = {"numpy": str(encoded["dense"].dtype),
                                       "length": int(encoded["dense"].shape[-1])}

        # An M3 model's three outputs in one call, as the SDK documents it for BAAI/bge-m3.
        m3 = client.encode(M3, [{"text": DOCS[0]}, {"text": DOCS[1]}],
                           output_types=["dense", "sparse", "multivector"])
        report["m3"] = [{"dense": item["dense"].tolist(),
                         "sparse": {"indices": item["sparse"]["indices"].tolist(),
                                    "values": item["sparse"]["values"].tolist()},
                         "multivector": item["multivector"].tolist()} for item in m3]
        # ...and its score weighed per call, as FlagEmbedding's compute_score is.
        report["m3_scores"] = client.score(
            M3, {"text": QUERY}, [{"id": "p", "text": DOCS[0]}, {"id": "s", "text": DOCS[1]}],
            options={"score_weights": {"dense": 0.4, "sparse": 0.2, "multivector": 0.4}}
        )["scores"]

        scored = client.score(MINILM, {"text": QUERY}, [{"id": "p", "text": DOCS[0]},
                                                        {"id": "s", "text": DOCS[1]}],
                              options={"truncate": False})
        report["scores"] = scored["scores"]
        long_item = {"text": "word " * 600}
        report["score_too_long"] = refusal(lambda: client.score(
            MINILM, {"text": QUERY}, [long_item], options={"truncate": False}))
        report["encode_too_long"] = refusal(lambda: client.encode(
            MINILM, long_item, options={"truncate": False}))
        report["score_truncated"] = len(client.score(
            MINILM, {"text": QUERY}, [long_item], options={"truncate": True})["scores"])
        report["score_instruction"] = refusal(lambda: client.score(
            MINILM, {"text": QUERY}, [{"text": DOCS[0]}], instruction="Rank for recall"))
        report["unknown_option"] = refusal(lambda: client.encode(
            MINILM, {"text": QUERY}, options={"profile": "fast"}))
        report["unknown_model"] = refusal(lambda: client.encode(
            "nobody/none", {"text": QUERY}))
        report["wrong_task"] = refusal(lambda: client.extract(MINILM, {"text": QUERY}))

        extracted = client.extract(SPACY, [{"id": "e", "text": "Barack Obama visited "
                                            "Paris in 2015."}], labels=["PERSON", "GPE"])
        report["entities"] = [{"id": item.get("id"),
                               "entities": [dict(e) for e in item["entities"]]}
                              for item in extracted]

        models = client.list_models()
        report["models"] = {m["name"]: {"dims": m.get("dims"), "loaded": m.get("loaded"),
                                        "outputs": m.get("outputs")} for m in models}
        report["get_model"] = dict(client.get_model(MINILM))
        report["get_unknown_model"] = refusal(lambda: client.get_model("nobody/none"))
    with open(out, "w", encoding="utf-8") as file:
        json.dump(report, file, default=lambda v: v.tolist() if isinstance(v, np.ndarray)
                  else str(v))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
