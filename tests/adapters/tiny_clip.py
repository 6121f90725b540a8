"""Tiny CLIP and SigLIP model folders with random weights, for the clip family's tests:
the real architectures (transformers' CLIPModel and SiglipModel) at a few thousand
parameters, with a WordPiece tokenizer and the checkpoint's own image processor config,
loaded by Ember through its real loader. Seeded; each builds in well under a second."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from tests.adapters.tiny_models import vocabulary, write_tokenizer

TEXT_POSITIONS = 16
IMAGE_SIZE = 32
PATCH = 8


def _towers() -> tuple[dict[str, object], dict[str, object]]:
    text = {"vocab_size": len(vocabulary()), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2,
            "max_position_embeddings": TEXT_POSITIONS, "pad_token_id": 0,
            "bos_token_id": 2, "eos_token_id": 3}  # [CLS] and [SEP] of the tokenizer
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": PATCH}
    return text, vision


def build_clip(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    text, vision = _towers()
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    CLIPModel(config).eval().save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, TEXT_POSITIONS)
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
                          ).save_pretrained(str(directory))
    return directory


def build_siglip(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    text, vision = _towers()
    config = SiglipConfig(text_config=text, vision_config=vision)
    SiglipModel(config).eval().save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, TEXT_POSITIONS)
    SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
                            ).save_pretrained(str(directory))
    return directory


def clip_yaml(name: str, directory: Path, **extra: str) -> str:
    lines = [f"name: {name}", "description: a tiny random vision-language test model",
             "adapter: clip", f"source: {{path: {directory}}}", "tasks: [encode, score]",
             *(f"{key}: {value}" for key, value in extra.items())]
    return "\n".join(lines) + "\n"
