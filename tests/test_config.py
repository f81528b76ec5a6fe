import pytest
from pydantic import ValidationError

from engine.config.dtype_policy import DTYPE_POLICIES, DtypePolicy, dtype_policy
from engine.config.presets import PRESETS, load_preset
from engine.config.stage_config import ThinkerConfig


def test_presets_have_the_spec_dimensions():
    big = load_preset("nemotron-voicechat-11b")
    t = big.thinker
    assert (t.num_layers, t.d_inner, t.conv_dim, t.in_proj_dim) == (56, 10240, 12288, 22656)
    assert t.layer_pattern.count("M") == 27
    assert t.layer_pattern.count("-") == 25
    assert t.layer_pattern.count("*") == 4
    assert big.clock.input_samples == 1280
    assert big.codec.samples_per_frame == big.clock.output_samples == 1764
    tiny = load_preset("tiny")
    assert tiny.codec.samples_per_frame == 1764
    assert tiny.thinker.hidden_size < t.hidden_size


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny"):
        load_preset("huge")


def test_inconsistent_fields_name_the_field():
    with pytest.raises(ValidationError, match="n_groups"):
        ThinkerConfig(mamba_num_heads=10, n_groups=3)
    with pytest.raises(ValidationError, match="layer_pattern"):
        ThinkerConfig(layer_pattern="MX")
    with pytest.raises(ValidationError, match="num_key_value_heads"):
        ThinkerConfig(num_attention_heads=10, num_key_value_heads=4)
    with pytest.raises(ValidationError, match="codec.upsample"):
        load_preset("tiny", codec={"upsample": (9, 7, 5)})
    with pytest.raises(ValidationError, match="extra"):
        ThinkerConfig(hiden_size=3)


def test_dtype_policy_auto_follows_the_device_and_names_the_choices():
    assert dtype_policy("auto", "cuda") == dtype_policy("gpu") != dtype_policy("auto", "cpu")
    assert dtype_policy("auto", "cpu") == dtype_policy("fp32")
    assert all(v == "float32" for k, v in dtype_policy("fp32").model_dump().items() if k != "name")
    custom = DtypePolicy(thinker="bfloat16")
    assert dtype_policy(custom, "cuda") is custom
    with pytest.raises(ValueError, match="unknown dtype policy 'bf16'.*auto.*fp32.*gpu"):
        dtype_policy("bf16")
    with pytest.raises(ValidationError, match="thinker_kv"):
        DtypePolicy(thinker_kv="int8")
    with pytest.raises(ValidationError, match="extra"):
        DtypePolicy(ssm="bfloat16")  # the SSM state is float32 under every policy


def test_the_named_presets_and_policies_cannot_be_changed_at_run_time():
    """The registries are read-only, so no module can add or replace a preset or a policy that another reads;
    a policy itself is frozen too."""
    with pytest.raises(TypeError):
        PRESETS["huge"] = PRESETS["tiny"]
    with pytest.raises(TypeError):
        DTYPE_POLICIES["gpu"] = DTYPE_POLICIES["fp32"]
    with pytest.raises(ValidationError, match="frozen"):
        DTYPE_POLICIES["gpu"].thinker = "float32"
    # capacity mode's policy is the gpu one with the talker's KV rings in bf16, and the gpu one is left
    # as it was
    capacity = dtype_policy("auto", "cuda", capacity=True)
    assert capacity.talker_kv == "bfloat16" != dtype_policy("gpu").talker_kv
