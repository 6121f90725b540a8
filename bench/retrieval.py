"""A small fixed retrieval set, and how far one embedding of it strays from another.

Used to judge a cheaper forward (int8) against float32: the cosine of each text's
two vectors, and per query the overlap of the two top-10 rankings of the documents.
The texts are built from fixed topic vocabularies with a fixed seed: ten documents
per topic that share its words unevenly, and queries that name some of them, so a
top-10 list holds near-ties that a sloppy forward would reorder.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

TOPICS = {
    "baking": "bread flour oven dough yeast crust bake loaf butter sugar",
    "football": "goal match striker league referee penalty stadium season coach team",
    "weather": "rain storm forecast wind cloud temperature snow sunny cold humid",
    "finance": "stock market shares investor price bank interest inflation bond fund",
    "medicine": "doctor patient fever vaccine hospital symptom treatment dose nurse clinic",
    "travel": "flight airport hotel passport luggage beach tourist ticket train visa",
    "gardening": "garden soil seeds tomato roses compost water prune harvest shovel",
    "computing": "server database query index cache memory code bug deploy network",
    "music": "guitar song concert piano melody album drummer band singer chord",
    "space": "planet orbit rocket astronaut moon telescope galaxy satellite launch mars",
    "cars": "engine tire brake fuel driver highway battery electric garage repair",
    "cooking": "pasta garlic sauce onion pepper salt pan recipe boil simmer",
}
FILLER = ["the", "a", "of", "and", "in", "on", "with", "for", "about", "today", "very",
          "some", "new", "old", "good", "many", "this", "that", "our", "their", "after",
          "before", "during"]


@dataclass(frozen=True)
class RetrievalSet:
    queries: list[str]
    documents: list[str]


def retrieval_set(docs_per_topic: int = 10, queries_per_topic: int = 2,
                  seed: int = 13) -> RetrievalSet:
    rng = random.Random(seed)
    documents, queries = [], []
    for words in TOPICS.values():
        vocab = words.split()
        for _ in range(docs_per_topic):
            picked = rng.sample(vocab, rng.randint(3, 7)) + rng.sample(FILLER, 5)
            rng.shuffle(picked)
            documents.append(" ".join(picked).capitalize() + ".")
        for _ in range(queries_per_topic):
            queries.append(" ".join(rng.sample(vocab, 3)) + "?")
    return RetrievalSet(queries, documents)


Matrix = npt.NDArray[np.float32]


def unit(rows: Matrix) -> npt.NDArray[np.float64]:
    rows64 = rows.astype(np.float64)
    return rows64 / np.maximum(np.linalg.norm(rows64, axis=1, keepdims=True), 1e-12)


def cosines(a: Matrix, b: Matrix) -> npt.NDArray[np.float64]:
    """Row by row: each text's vector from one forward against the other's."""
    return np.asarray((unit(a) * unit(b)).sum(axis=1))


def top_k_overlap(queries_a: Matrix, docs_a: Matrix, queries_b: Matrix, docs_b: Matrix,
                  k: int = 10) -> npt.NDArray[np.float64]:
    """Per query, the share of the top-k documents the two embeddings agree on."""
    rank_a = np.argsort(-(unit(queries_a) @ unit(docs_a).T), axis=1)[:, :k]
    rank_b = np.argsort(-(unit(queries_b) @ unit(docs_b).T), axis=1)[:, :k]
    return np.array([len(set(x) & set(y)) / k for x, y in zip(rank_a, rank_b, strict=True)])
