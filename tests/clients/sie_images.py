"""Driven by test_sie_sdk.py in the Python 3.12 environment with sie-sdk 0.10.1: the SDK's
image items (encoded bytes, a PIL image, an `{data, format}` dict) encoded and scored
against a live Ember serving a tiny CLIP model, what came back written as JSON.

    python sie_images.py BASE_URL MODEL IMAGES_DIR OUT.json
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from sie_sdk import SIEClient
from sie_sdk.client.errors import RequestError
from sie_sdk.images import to_jpeg_bytes


def main(url: str, model: str, images_dir: str, out: str) -> None:
    folder = Path(images_dir)
    pngs = [(folder / f"{i}.png").read_bytes() for i in range(2)]
    picture = Image.open(folder / "0.png")
    report: dict[str, Any] = {}
    with SIEClient(url, timeout_s=120) as client:
        batch = client.encode(model, [{"id": "p", "images": [pngs[0]]},
                                      {"images": [{"data": pngs[1], "format": "png"}]},
                                      {"id": "t", "text": "a cat on a tree"}])
        report["ids"] = [item.get("id") for item in batch]
        report["vectors"] = [item["dense"].tolist() for item in batch]
        single = client.encode(model, {"images": [picture]})  # the SDK sends it as JPEG
        report["pil_vector"] = single["dense"].tolist()
        report["pil_jpeg"] = base64.b64encode(to_jpeg_bytes(picture)).decode()
        scored = client.score(model, {"images": [pngs[1]]},
                              [{"id": "other", "images": [pngs[0]]},
                               {"id": "same", "images": [pngs[1]]},
                               {"id": "text", "text": "the river"}])
        report["scores"] = scored["scores"]
        try:
            client.encode(model, {"images": [pngs[0][:60]]})
            report["truncated"] = None
        except RequestError as exc:
            report["truncated"] = {"status": exc.status_code, "param": exc.param}
    with open(out, "w", encoding="utf-8") as file:
        json.dump(report, file, default=lambda v: v.tolist() if isinstance(v, np.ndarray)
                  else str(v))


if __name__ == "__main__":
    main(*sys.argv[1:5])
