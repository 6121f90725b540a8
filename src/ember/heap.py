"""The garbage collector, set for a long-running server.

Objects that live as long as the process (imported modules, loaded models: hundreds of
thousands from torch and transformers) are moved out of the collector's generations, so
a full collection walks only what requests left behind. Before, each full collection
walked them all and stalled the event loop for tens of milliseconds: the p99 outliers of
the front-end benchmark (docs/benchmarks.md, "Front end")."""

from __future__ import annotations

import gc


def settle() -> None:
    """After start-up or a model load: collect once, then freeze what survived."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Before a model is let go: frozen objects are never collected, so its reference
    cycles would outlive it. `settle` after it is gone."""
    gc.unfreeze()
