"""Ember: a self-hosted inference engine for embeddings, reranking and extraction."""

import os

# ONNX Runtime writes a device id and a telemetry database under ~/.cache when it is
# imported, whatever --cache-dir says; a self-hosted server keeps to its own folders.
# Set before any import of it (GLiNER's package imports it too); an operator's value wins.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"
