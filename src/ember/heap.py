"""The garbage collector, set for a long-running server.

Objects that live as long as the process (imported modules, loaded models: hundreds of
thousands from torch and transformers) are moved out of the collector's generations, so
a full collection walks only what requests left behind. Before, each full collection
walked them all and stalled the event loop for tens of milliseconds: the p99 outliers of
the front-end benchmark (docs/benchmarks.md, "Front end").

The collections themselves run far less often than Python's default (one every 700 new
objects): under load that default ran several a request, each walking every object of the
requests in flight (8-9 % of the server's CPU in a `perf` profile). Refcounting frees
nearly all a request makes; the collector is only for the rare cycle, and a hundred
thousand objects of those are a few megabytes.
"""

from __future__ import annotations

import gc

# Tracked objects made (less those freed) before a young collection; young collections
# before a middle one; middle ones before a full one (Python's defaults: 700, 10, 10).
THRESHOLDS = (100_000, 50, 50)


def settle() -> None:
    """After start-up or a model load: collect once, freeze what survived, and set the
    collector's thresholds for serving."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


def thaw() -> None:
    """Before a model is let go: frozen objects are never collected, so its reference
    cycles would outlive it. `settle` after it is gone."""
    gc.unfreeze()
