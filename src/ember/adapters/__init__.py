"""Model families: each module turns prepared items into one forward of one kind of model.

Each family module exposes `load(spec, runtime) -> ModelAdapter`; the registry imports
a family only when a model of it loads, so torch and spaCy stay out of processes that
never need them (config.ADAPTERS maps catalog names to modules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Static proof that every family satisfies the ModelAdapter protocol.
    from ember.adapters import (
        clip,
        cross_encoder,
        gliner,
        m3,
        multivector,
        spacy_ner,
        sparse,
        synthetic,
        transformer,
    )
    from ember.adapters.base import ModelAdapter, Runtime
    from ember.config import ModelSpec

    _FAMILIES: tuple[Callable[[ModelSpec, Runtime], ModelAdapter], ...] = (
        transformer.load, cross_encoder.load, spacy_ner.load, synthetic.load, sparse.load,
        multivector.load, m3.load, clip.load, gliner.load)
