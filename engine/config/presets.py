"""The named presets: every dimension of every stage, validated once by `ModelConfig`.

`load_preset("tiny")` is sized so the whole pipeline serves 64 slots inside the 80 ms tick on a 2-core CPU,
`load_preset("nemotron-voicechat-11b")` has the released model's dimensions. Knows dimensions only: nothing of
dtypes (engine/config/dtype_policy.py), checkpoints, the environment or devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from engine.config.stage_config import CodecConfig, ModelConfig, PerceptionConfig, TalkerConfig, ThinkerConfig


def _tiny() -> ModelConfig:
    return ModelConfig(
        name="tiny",
        thinker=ThinkerConfig(
            hidden_size=128,
            vocab_size=512,
            layer_pattern="M-M*M-*-",
            mamba_num_heads=8,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            mamba_chunk_size=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            attention_window=256,
            intermediate_size=512,
        ),
        perception=PerceptionConfig(
            num_layers=2,
            d_model=64,
            num_heads=4,
            subsampling_channels=32,
        ),
        talker=TalkerConfig(
            hidden_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=1,
            head_dim=32,
            intermediate_size=512,
            sliding_window=256,
            sliding_pattern=2,
            attention_window=512,
            vocab_size=512,
            char_hidden_size=128,
            char_heads=4,
            char_kv_heads=4,
            char_head_dim=32,
            char_intermediate_size=256,
            codebook_size=64,
            latent_dim=32,
            mog_intermediate_size=256,
            mog_components=64,
            mog_rank=8,
            query_pre_attn_scalar=32.0,
        ),
        codec=CodecConfig(codebook_size=64, latent_dim=32, channels=(16, 8, 4)),
    )


def _nemotron_voicechat_11b() -> ModelConfig:
    return ModelConfig(name="nemotron-voicechat-11b")


# Read-only: a run picks a preset by name and overrides fields through `load_preset`, never adds one.
PRESETS: Mapping[str, Callable[[], ModelConfig]] = MappingProxyType(
    {"tiny": _tiny, "nemotron-voicechat-11b": _nemotron_voicechat_11b}
)


def load_preset(name: str, **overrides: object) -> ModelConfig:
    """The named preset, with top-level fields replaced by `overrides` (validated again)."""
    try:
        build = PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
    cfg = build()
    if overrides:
        cfg = ModelConfig.model_validate({**cfg.model_dump(), **overrides})
    return cfg
