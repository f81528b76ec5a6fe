"""The tiny NeMo-built model's weights, one file for every stage (tests/fixtures/model/model.safetensors, made
by scripts/fixtures/make_model_fixtures.py): a stage's tests take its own tensors from it, by the loader's
routing of release names to stages."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model.weights import stage_of

WHOLE = Path(__file__).parent / "fixtures" / "model" / "model.safetensors"


def stage_weights(stage: str) -> dict[str, torch.Tensor]:
    """The release tensors of `stage` ("perception", "thinker", "talker", "codec"), freshly loaded."""
    return {name: t for name, t in load_file(str(WHOLE)).items() if stage_of(name) == stage}
