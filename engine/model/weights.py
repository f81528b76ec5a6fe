"""Loading a release checkpoint (`model.safetensors` in NVIDIA's naming) into the pipeline's stages.

Each stage owns its name table (its module names are the release names less a prefix) and a loader that
returns the tensors it consumed; this module runs them all and accounts for every tensor of the file.
Knows file layout and stage prefixes; knows nothing of slots or time.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import codec, perception, talker, thinker

log = logging.getLogger("chorus.weights")

# Release tensors that inference does not use, by prefix: the user-transcript (RNNT) branch.
UNUSED_PREFIXES = ("stt_model.rnnt_decoder.", "stt_model.rnnt_joint.")


class CheckpointError(ValueError):
    """The checkpoint is missing, unreadable, or does not match the preset."""


def resolve(path: str | Path) -> Path:
    """A checkpoint folder (with model.safetensors) or the file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.is_file():
        raise CheckpointError(f"checkpoint: no model.safetensors at {str(path)!r}")
    return p


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    p = resolve(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"checkpoint: cannot read {str(p)!r}: {e}") from e


def load_into(pipeline, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Load every stage; return the names consumed. Raises CheckpointError on anything unaccounted for."""
    consumed: set[str] = set()
    stages = (
        ("thinker", thinker.load_release_weights, pipeline.thinker),
        ("perception", perception.load_release_weights, pipeline.perception),
        ("talker", talker.load_release_weights, pipeline.talker),
        ("codec", codec.load_release_weights, pipeline.codec),
    )
    for name, load, module in stages:
        try:
            consumed |= set(load(module, tensors))
        except ValueError as e:
            raise CheckpointError(f"checkpoint does not fit the {name}: {e}") from e
    unused = {k for k in tensors if k.startswith(UNUSED_PREFIXES)} | codec.ignored_release_names(tensors)
    unused |= set(perception.IGNORED_RELEASE_NAMES) & set(tensors)
    left = sorted(set(tensors) - consumed - unused)
    if left:
        raise CheckpointError(f"checkpoint has {len(left)} tensors no stage knows, e.g. {left[:5]}")
    return consumed


def load_checkpoint(pipeline, path: str | Path) -> None:
    tensors = read_tensors(path)
    consumed = load_into(pipeline, tensors)
    log.info("loaded %d tensors from %s", len(consumed), resolve(path))
