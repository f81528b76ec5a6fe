"""The release's NeMo `config.json`, beside its weights: read, mapped onto `ModelConfig` fields, checked.

`derive_dims` turns every dimension the config states into the field it sets, `check_release_config` compares
them with a preset and `release_config` writes one for synthetic checkpoints. Knows config keys and the
preset's fields; knows nothing of tensors, the weights file's format (engine/model/checkpoint.py),
modules or devices.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from engine.config.stage_config import ModelConfig
from engine.model.checkpoint import WEIGHTS_FILE, CheckpointError

CONFIG_FILE = "config.json"


def read_release_config(path: str | Path) -> dict | None:
    """The NeMo config.json of a checkpoint folder; a bare weights file given alone has none (None)."""
    p = Path(path)
    if p.is_file():
        if not (p.parent / CONFIG_FILE).is_file():
            return None
        p = p.parent
    cfg_path = p / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(
            f"checkpoint: no {CONFIG_FILE} in {str(path)!r} (the release ships one beside {WEIGHTS_FILE}; "
            f"point --checkpoint at the downloaded folder)"
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint: cannot read {cfg_path}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise CheckpointError(f"checkpoint: {cfg_path} is not a NeMo config (no 'model' section)")
    return raw


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _require(problems: list[str], where: str, value: Any, allowed: tuple) -> None:
    if value is not None and value not in allowed:
        problems.append(f"{where} = {value!r}: Chorus implements only {' / '.join(map(repr, allowed))}")


# a transformer's layers and heads: ours, after a prefix (`num_`, `char_`) -> Hugging Face's names
_LAYERS = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads"}


def derive_dims(raw: dict) -> tuple[dict[str, Any], list[str]]:
    """Every dimension the release config states, keyed by the ModelConfig field it sets, and the values
    Chorus does not implement (unknown architecture switches). Keys a config leaves out are absent."""
    out: dict[str, Any] = {}
    bad: list[str] = []

    def put(field: str, value: Any, convert=int) -> None:
        if value is not None:
            out[field] = convert(value)

    def talker(part: dict, prefix: str, *same: str, convert=int, **renamed: str) -> None:
        # the talker's fields `prefix + name` from the config's `part`: under the same names, or renamed
        for ours, theirs in [*zip(same, same, strict=True), *renamed.items()]:
            put(f"talker.{prefix}{ours}", part.get(theirs), convert)

    data = raw.get("data") or {}
    put("clock.input_rate", data.get("source_sample_rate"))
    put("clock.output_rate", data.get("target_sample_rate"))
    if data.get("frame_length") is not None:
        out["clock.frame_ms"] = round(float(data["frame_length"]) * 1000)

    stt = _get(raw, "model", "stt", "model") or {}
    _require(bad, "model.stt.model.base_model_name", stt.get("base_model_name"), ("backbone",))
    for key in ("embed_tokens_name", "embed_tokens_attr_name"):
        _require(bad, f"model.stt.model.{key}", stt.get(key), ("embeddings",))
    _require(bad, "model.stt.model.fuse_method", stt.get("fuse_method"), ("add",))
    _require(bad, "model.stt.model.predict_user_text", stt.get("predict_user_text"), (False,))
    for ours, theirs in (("bos", "bos_token"), ("eos", "eos_token"), ("pad", "pad_token")):
        put(f"tokens.{ours}", stt.get(theirs), str)
    for ours, theirs in (("text", "text"), ("audio", "user"), ("function", "function")):
        put(f"thinker.{ours}_weight", stt.get(f"duplex_{theirs}_channel_weight"), float)
    if stt.get("use_function_head") is False:
        out["thinker.function_weight"] = 0.0

    per = stt.get("perception") or {}
    pre, enc = per.get("preprocessor") or {}, per.get("encoder") or {}
    rate = pre.get("sample_rate") or data.get("source_sample_rate") or 16_000
    put("perception.n_mels", pre.get("features"))
    put("perception.n_fft", pre.get("n_fft"))
    if pre.get("window_size") is not None:
        out["perception.win_length"] = round(float(pre["window_size"]) * rate)
    if pre.get("window_stride") is not None:
        out["perception.hop_length"] = round(float(pre["window_stride"]) * rate)
    put("perception.preemph", pre.get("preemph"), float)
    _require(bad, "perception.preprocessor.window", pre.get("window"), ("hann",))
    _require(bad, "perception.preprocessor.normalize", pre.get("normalize"), ("NA", None))
    if (
        enc.get("feat_in") is not None
        and pre.get("features") is not None
        and enc["feat_in"] != pre["features"]
    ):
        bad.append(
            f"perception.encoder.feat_in = {enc['feat_in']} contradicts preprocessor.features = "
            f"{pre['features']}"
        )
    for ours, theirs in (
        ("num_layers", "n_layers"),
        ("d_model", "d_model"),
        ("num_heads", "n_heads"),
        ("ff_expansion", "ff_expansion_factor"),
        ("conv_kernel", "conv_kernel_size"),
        ("subsampling_factor", "subsampling_factor"),
        ("subsampling_channels", "subsampling_conv_channels"),
        ("pos_emb_max_len", "pos_emb_max_len"),
    ):
        put(f"perception.{ours}", enc.get(theirs))
    ctx = enc.get("att_context_size")
    if ctx is not None:
        pairs = ctx if ctx and isinstance(ctx[0], list | tuple) else [ctx]
        out["perception.att_context"] = [tuple(int(v) for v in p) for p in pairs]
    for key, allowed in (
        ("subsampling", ("dw_striding",)),
        ("self_attention_model", ("rel_pos",)),
        ("att_context_style", ("chunked_limited",)),
        ("conv_norm_type", ("layer_norm",)),
        ("conv_context_size", ("causal",)),
        ("causal_downsampling", (True,)),
        ("xscaling", (False,)),
        ("use_bias", (False,)),
    ):
        _require(bad, f"perception.encoder.{key}", enc.get(key), allowed)
    put("perception.output_dim", per.get("output_dim"))

    gen = _get(raw, "model", "speech_generation", "model") or {}
    tts = gen.get("tts_config") or {}
    _require(bad, "tts_config.backbone_type", tts.get("backbone_type"), ("gemma3_text",))
    bb = tts.get("backbone_config") or {}
    talker(bb, "", "hidden_size", "intermediate_size", "head_dim", "sliding_window")
    talker(bb, "num_", **_LAYERS)
    talker(bb, "", "query_pre_attn_scalar", "rope_theta", convert=float)
    talker(bb, "", convert=float, rope_local_theta="rope_local_base_freq", rms_eps="rms_norm_eps")
    if bb.get("layer_types") is not None:
        out["talker.layer_types"] = tuple(
            {"sliding_attention": "sliding", "full_attention": "global"}.get(t, t) for t in bb["layer_types"]
        )
    put("talker.latent_dim", tts.get("latent_size"))
    put("talker.num_codebooks", tts.get("num_quantizers"))
    put("talker.codebook_size", tts.get("codebook_size"))
    put("talker.schedule_exponent", tts.get("exponent"), float)
    cas = _get(tts, "cas_config", "backbone_config", "encoder") or {}
    _require(
        bad, "tts_config.cas_config.backbone_type", _get(tts, "cas_config", "backbone_type"), ("t5gemma",)
    )
    talker(cas, "char_", "hidden_size", "intermediate_size", "head_dim", **_LAYERS)
    mog = tts.get("mog_head_config") or {}
    talker(
        mog, "mog_", "intermediate_size", layers="num_layers", components="num_predictions", rank="low_rank"
    )
    put("talker.log_std_min", mog.get("min_log_std"), float)
    for key in ("use_subword_flag_emb", "use_bos_eos_emb", "use_gated_fusion_for_text_audio"):
        _require(bad, f"tts_config.{key}", tts.get(key), (True,))

    codec = gen.get("codec_config") or {}
    put("codec.latent_dim", codec.get("latent_size"))
    put("codec.n_fft", codec.get("n_fft"))
    put("codec.hop_length", codec.get("hop_length"))
    put("codec.codebook_size", codec.get("codebook_size"))
    put("codec.num_codebooks", codec.get("num_quantizers"))
    put("codec.blocks_per_stage", codec.get("num_blocks"))
    put("codec.block_kernel", codec.get("kernel_size"))
    _require(bad, "codec_config.groups", codec.get("groups"), (1,))
    if codec.get("base_hidden_size") is not None and codec.get("channel_mult") is not None:
        out["codec.channels"] = tuple(int(codec["base_hidden_size"]) * int(m) for m in codec["channel_mult"])[
            ::-1
        ]
    if codec.get("rates") is not None:
        out["codec.upsample"] = tuple(int(r) for r in codec["rates"])[::-1]
    for a, b in (
        ("talker.num_codebooks", "codec.num_codebooks"),
        ("talker.codebook_size", "codec.codebook_size"),
        ("talker.latent_dim", "codec.latent_dim"),
    ):
        if a in out and b in out and out[a] != out[b]:
            bad.append(f"{a} = {out[a]} contradicts {b} = {out[b]} within the config")
    return out, bad


def _ours(cfg: ModelConfig, field: str) -> Any:
    if field == "perception.att_context":
        p = cfg.perception
        return (p.att_context_left, p.att_context_right)
    if field == "perception.output_dim":
        return cfg.perception.output_dim or cfg.thinker.hidden_size
    obj: Any = cfg
    for part in field.split("."):
        obj = getattr(obj, part)
    return tuple(obj) if isinstance(obj, list | tuple) else obj


def check_release_config(raw: dict, cfg: ModelConfig) -> dict[str, Any]:
    """Derive the release's dimensions and compare them with the preset; CheckpointError lists every value
    Chorus does not implement and every dimension that contradicts the preset. Returns the derived values."""
    derived, problems = derive_dims(raw)
    for field, theirs in derived.items():
        ours = _ours(cfg, field)
        if field == "perception.att_context":
            if ours not in theirs:
                problems.append(f"{field}: the release streams with {theirs}, the preset with {ours}")
        elif isinstance(theirs, float) and isinstance(ours, int | float):
            if not math.isclose(theirs, ours, rel_tol=1e-6, abs_tol=1e-12):
                problems.append(f"{field}: release {theirs}, preset {ours}")
        elif theirs != ours:
            problems.append(f"{field}: release {theirs!r}, preset {ours!r}")
    if problems:
        raise CheckpointError(
            f"checkpoint config.json does not fit the preset {cfg.name!r} ({len(problems)} problems): "
            + "; ".join(problems)
        )
    return derived


def release_config(cfg: ModelConfig) -> dict:
    """A NeMo config.json in the release's layout stating every dimension of `cfg` (synthetic checkpoints)."""
    p, t, c = cfg.perception, cfg.talker, cfg.codec
    rate = cfg.clock.input_rate
    data = {
        "source_sample_rate": rate,
        "target_sample_rate": cfg.clock.output_rate,
        "frame_length": cfg.clock.frame_ms / 1000,
    }
    base = c.channels[-1]
    stt = {
        "pretrained_llm": "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
        "base_model_name": "backbone",
        "embed_tokens_name": "embeddings",
        "bos_token": cfg.tokens.bos,
        "eos_token": cfg.tokens.eos,
        "pad_token": cfg.tokens.pad,
        "fuse_method": "add",
        "predict_user_text": False,
        "use_function_head": True,
        "duplex_text_channel_weight": cfg.thinker.text_weight,
        "duplex_user_channel_weight": cfg.thinker.audio_weight,
        "duplex_function_channel_weight": cfg.thinker.function_weight,
        "perception": {
            "output_dim": p.output_dim or cfg.thinker.hidden_size,
            "preprocessor": {
                "sample_rate": rate,
                "normalize": "NA",
                "window_size": p.win_length / rate,
                "window_stride": p.hop_length / rate,
                "window": "hann",
                "features": p.n_mels,
                "n_fft": p.n_fft,
                "dither": 0.0,
                "preemph": p.preemph,
            },
            "encoder": {
                "feat_in": p.n_mels,
                "n_layers": p.num_layers,
                "d_model": p.d_model,
                "subsampling": "dw_striding",
                "subsampling_factor": p.subsampling_factor,
                "subsampling_conv_channels": p.subsampling_channels,
                "causal_downsampling": True,
                "ff_expansion_factor": p.ff_expansion,
                "self_attention_model": "rel_pos",
                "n_heads": p.num_heads,
                "att_context_size": [p.att_context_left, p.att_context_right],
                "att_context_style": "chunked_limited",
                "xscaling": False,
                "pos_emb_max_len": p.pos_emb_max_len,
                "conv_kernel_size": p.conv_kernel,
                "conv_norm_type": "layer_norm",
                "conv_context_size": "causal",
                "use_bias": False,
            },
        },
    }
    layer_types = ["full_attention" if k == "global" else "sliding_attention" for k in t.layer_types]
    tts = {
        "backbone_type": "gemma3_text",
        "backbone_config": {
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim,
            "query_pre_attn_scalar": t.query_pre_attn_scalar,
            "sliding_window": t.sliding_window,
            "layer_types": layer_types,
            "rope_theta": t.rope_theta,
            "rope_local_base_freq": t.rope_local_theta,
            "rms_norm_eps": t.rms_eps,
        },
        "latent_size": t.latent_dim,
        "num_quantizers": t.num_codebooks,
        "codebook_size": t.codebook_size,
        "exponent": t.schedule_exponent,
        "cas_config": {
            "backbone_type": "t5gemma",
            "backbone_config": {
                "is_encoder_decoder": False,
                "encoder": {
                    "hidden_size": t.char_hidden_size,
                    "intermediate_size": t.char_intermediate_size,
                    "num_hidden_layers": t.char_layers,
                    "num_attention_heads": t.char_heads,
                    "num_key_value_heads": t.char_kv_heads,
                    "head_dim": t.char_head_dim,
                },
            },
        },
        "use_subword_flag_emb": True,
        "use_bos_eos_emb": True,
        "use_gated_fusion_for_text_audio": True,
        "use_audio_prompt_frozen_projection": True,
        "mog_head_config": {
            "intermediate_size": t.mog_intermediate_size,
            "num_layers": t.mog_layers,
            "num_predictions": t.mog_components,
            "low_rank": t.mog_rank,
            "min_log_std": t.log_std_min,
        },
    }
    codec = {
        "latent_size": c.latent_dim,
        "n_fft": c.n_fft,
        "hop_length": c.hop_length,
        "base_hidden_size": base,
        "channel_mult": [ch // base for ch in c.channels[::-1]],
        "rates": list(c.upsample[::-1]),
        "num_blocks": c.blocks_per_stage,
        "kernel_size": c.block_kernel,
        "groups": 1,
        "codebook_size": c.codebook_size,
        "num_quantizers": c.num_codebooks,
        "wav_to_token_ratio": c.samples_per_frame,
    }
    gen = {
        "data": data,
        "model": {
            "pretrained_lm_name": stt["pretrained_llm"],
            "bos_token": cfg.tokens.bos,
            "eos_token": cfg.tokens.eos,
            "pad_token": cfg.tokens.pad,
            "tts_config": tts,
            "codec_config": codec,
        },
    }
    return {
        "data": data,
        "trainer": {},
        "exp_manager": {},
        "model": {"stt": {"model": stt}, "speech_generation": gen},
    }
