"""The garbage collector, set for a long-running server.

Objects that live as long as the process (imported modules, loaded models: hundreds of
thousands from torch and transformers) are moved out of the collector's generations, so
a full collection walks only what requests left behind. Before, each full collection
walked them all and stalled the event loop for tens of milliseconds: the p99 outliers of
the front-end benchmark (docs/bench/notes.md, "Front end").

The collections themselves run far less often than Python's default (one every 700 new
objects): under load that default ran several a request, each walking every object of the
requests in flight (8-9 % of the server's CPU in a `perf` profile). Refcounting frees
nearly all a request makes; the collector is only for the rare cycle, and a hundred
thousand objects of those are a few megabytes.

A model load or eviction never collects on the spot (that walk stalls every model's
dispatch); the whole heap is collected once the server has been idle a moment.
"""

from __future__ import annotations

import gc

# Tracked objects made (less those freed) before a young collection; young collections
# before a middle one; middle ones before a full one (Python's defaults: 700, 10, 10).
THRESHOLDS = (100_000, 50, 50)


def settle() -> None:
    """After start-up: collect once, freeze what survived, and set the collector's
    thresholds for serving."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


def freeze_new() -> None:
    """After a model load: move what the load made out of the generations, without a
    collection. A collection holds the GIL for the whole walk: 0.1-0.4 s on this machine
    with all-MiniLM-L6-v2 and spaCy loaded, a stall of every other model's dispatch. What
    the load left as cyclic garbage stays frozen until `collect_all`."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


def collect_all() -> None:
    """Thaw, collect everything and freeze again: frees evicted models' reference cycles
    and the loads' frozen garbage. It walks the whole heap, so the registry runs it only
    when no request is in flight."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
