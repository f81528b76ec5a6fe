"""In which dtype each stage of the model runs: `DtypePolicy`, the named policies and `dtype_policy(name)`.

A policy is chosen beside the preset (by the engine and the benchmarks), not by it: it knows the stages by
name and nothing of their dimensions, of devices beyond their type, or of the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict

DType = Literal["float32", "bfloat16", "float16"]


class DtypePolicy(BaseModel):
    """The dtype of every stage: its weights and activations, and its attention KV cache (`*_kv`), in which
    its attention runs (scores and softmax in float32). A stage's other per-slot state (conv caches) is in
    the stage's dtype, and each stage casts what it receives to its own dtype; tokens and audio leave the
    pipeline as int64 / float32.

    What no policy changes: the Mamba SSM state is float32 (bf16 state drifts, MODEL_SPEC 3), and so are
    the mel front end with its audio and mel tails, the talker's sampling (component logits, means, RVQ
    quantisation) and the codec's codebooks, iSTFT head and overlap state.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    perception: DType = "float32"  # the conformer encoder and the projection
    perception_kv: DType = "float32"
    thinker: DType = "float32"
    thinker_kv: DType = "float32"
    talker: DType = "float32"  # the Gemma3 backbone and the MoG head's MLP stack
    talker_kv: DType = "float32"
    codec: DType = "float32"  # the ConvNeXt decoder


# Named policies. "gpu": bf16 wherever parity with the reference allows; the measured losses and the
# tolerances that hold them are in the stages' tests (tests/test_{perception,thinker,talker,codec}.py).
# Perception and thinker in bf16 are ~1.4e-2 off NeMo (relative L2). The talker stays fp32, its KV ring
# included: with only the ring in bf16 its deterministic codes already leave NeMo's from the first frame
# (MODEL_SPEC 4: bf16 talkers were reported to hallucinate). The codec stays fp32 (MODEL_SPEC 5): its bf16
# decoder's audio is ~25 dB SNR against the reference's.
_GPU = DtypePolicy(
    name="gpu", perception="bfloat16", perception_kv="bfloat16", thinker="bfloat16", thinker_kv="bfloat16"
)
# Read-only: a policy is chosen by name or passed whole, never registered at run time.
DTYPE_POLICIES: Mapping[str, DtypePolicy] = MappingProxyType(
    {
        "fp32": DtypePolicy(name="fp32"),
        "gpu": _GPU,
        # capacity mode's: the gpu policy with the talker's KV rings in bf16 as well (half their bytes; the
        # talker's weights, activations and attention arithmetic stay fp32). Its cost against fp32:
        # tests/test_pipeline.py.
        "capacity": _GPU.model_copy(update={"name": "capacity", "talker_kv": "bfloat16"}),
    }
)
DtypePolicyName = Literal["auto", "fp32", "gpu", "capacity"]


def dtype_policy(
    name: DtypePolicyName | DtypePolicy, device_type: str = "cpu", capacity: bool = False
) -> DtypePolicy:
    """The named policy; "auto" is "gpu" on a CUDA device ("capacity" in capacity mode) and "fp32" anywhere
    else. A policy passes through."""
    if isinstance(name, DtypePolicy):
        return name
    if name == "auto":
        name = ("capacity" if capacity else "gpu") if device_type == "cuda" else "fp32"
    try:
        return DTYPE_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"dtype: unknown dtype policy {name!r}; choose one of {sorted([*DTYPE_POLICIES, 'auto'])}"
        ) from None
