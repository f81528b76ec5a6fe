"""Typed, validated configuration of the model: one frozen object per stage and `ModelConfig` joining them.

The defaults are the released model's; named presets are built in engine/config/presets.py and the dtypes each
stage runs in are chosen apart from them (engine/config/dtype_policy.py). Nothing here reads the environment
or touches a device.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

ASSETS = Path(__file__).resolve().parent / "assets"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClockConfig(_Frozen):
    """The frame clock: one step of every stage per frame."""

    frame_ms: int = 80
    input_rate: int = 16_000
    output_rate: int = 22_050

    @property
    def input_samples(self) -> int:
        return self.input_rate * self.frame_ms // 1000

    @property
    def output_samples(self) -> int:
        return self.output_rate * self.frame_ms // 1000


class TokenConfig(_Frozen):
    """Special tokens, resolved by string through the tokenizer (ids differ between tokenizers)."""

    tokenizer: str = str(ASSETS / "tiny_tokenizer.json")
    bos: str = "<s>"
    eos: str = "</s>"
    pad: str = "<SPECIAL_12>"
    tool_call_start: str = "<SPECIAL_20>"
    tool_call_end: str = "<SPECIAL_21>"
    tool_response_end: str = "<SPECIAL_22>"


class ThinkerConfig(_Frozen):
    """NemotronH backbone (hybrid Mamba2 / attention / MLP) with a text and a function head."""

    hidden_size: int = 4480
    vocab_size: int = 131_072
    # M = Mamba2, - = MLP, * = attention; one character per layer.
    layer_pattern: str = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
    norm_eps: float = 1e-5
    # Mamba2 mixer
    mamba_num_heads: int = 128
    mamba_head_dim: int = 80
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    mamba_chunk_size: int = 128
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    # lower clamp of softplus(dt) on both the step and the chunked scan. 0: none, as the deployed path runs:
    # vLLM's MambaMixer2 (vllm/model_executor/layers/mamba/mamba_mixer2.py, forward_cuda) passes
    # `dt_limit=(0.0, inf)` to `mamba_chunk_scan_combined` on prefill and calls `selective_state_update(...,
    # dt_softplus=True)` with no limit on decode. (transformers' NemotronH clamps at time_step_min on its
    # chunked path only; its own step does not.)
    time_step_limit_min: float = 0.0
    # attention mixer (no RoPE in the release; no bias)
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_window: int = 8192
    # MLP mixer (squared ReLU, no gate)
    intermediate_size: int = 15_680
    # additive input fusion x = wt*E(text) + wa*audio + wf*E(func)
    text_weight: float = 1.0
    audio_weight: float = 1.0
    function_weight: float = 2.0
    init_std: float = 0.02

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        return self.d_inner + self.conv_dim + self.mamba_num_heads

    @model_validator(mode="after")
    def _check(self) -> ThinkerConfig:
        bad = set(self.layer_pattern) - set("M-*")
        if not self.layer_pattern or bad:
            raise ValueError(f"layer_pattern: only 'M', '-', '*' allowed, got {sorted(bad) or 'empty'}")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(
                f"n_groups: {self.n_groups} must divide mamba_num_heads ({self.mamba_num_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.attention_window < 1:
            raise ValueError("attention_window: must be at least 1")
        return self


class PerceptionConfig(_Frozen):
    """Mel front end + cache-aware streaming FastConformer + projection to the thinker's width."""

    # mel front end
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    n_mels: int = 128
    preemph: float = 0.97
    log_zero_guard: float = 2.0**-24
    # encoder
    num_layers: int = 24
    d_model: int = 1024
    num_heads: int = 8
    ff_expansion: int = 4
    conv_kernel: int = 9
    subsampling_factor: int = 8
    subsampling_channels: int = 256
    att_context_left: int = 70
    att_context_right: int = 0
    pos_emb_max_len: int = 5000
    # streaming geometry, in mel columns / encoder frames
    chunk_mel: int = 8
    pre_encode_cache: int = 9
    drop_extra_pre_encoded: int = 2
    # projection to the thinker's width (None: the thinker's hidden_size)
    output_dim: int | None = None

    @model_validator(mode="after")
    def _check(self) -> PerceptionConfig:
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads: {self.num_heads} must divide d_model ({self.d_model})")
        if self.subsampling_factor & (self.subsampling_factor - 1):
            raise ValueError(f"subsampling_factor: must be a power of two, got {self.subsampling_factor}")
        if self.conv_kernel % 2 == 0:
            raise ValueError(f"conv_kernel: must be odd, got {self.conv_kernel}")
        return self


class TalkerConfig(_Frozen):
    """EAR-TTS talker: char-aware subword encoder, Gemma3 backbone, MoG head with iterative unmasking.

    Names follow NeMo's `RVQEARTTSModel` (speechlm2, 3.0.0) and transformers' `gemma3_text` / `t5gemma`
    defaults, which the release relies on. [U] fields: no public source confirmed them.
    """

    # Gemma3 backbone
    hidden_size: int = 1152
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 16
    head_dim: int = 72
    intermediate_size: int = 4608
    sliding_window: int = 7500
    # every `sliding_pattern`-th layer is global (full attention), the others slide
    sliding_pattern: int = 6
    # ring capacity of the global layers: the reference grows without bound; Chorus keeps a window [U]
    attention_window: int = 8192
    query_pre_attn_scalar: float = 256.0
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rms_eps: float = 1e-6
    # text conditioning: the thinker's vocabulary, resolved by string through the tokenizer
    vocab_size: int = 131_072
    bos_token: str = "<s>"
    eos_token: str = "</s>"
    pad_token: str = "<SPECIAL_12>"
    # character encoder (t5gemma encoder, bidirectional, one layer) [U: widths]
    char_vocab_size: int = 256
    char_hidden_size: int = 1152
    char_layers: int = 1
    char_heads: int = 16
    char_kv_heads: int = 16
    char_head_dim: int = 72
    char_intermediate_size: int = 4608
    char_softcap: float = 50.0
    char_query_pre_attn_scalar: float = 256.0
    char_rope_theta: float = 10_000.0
    # codes
    num_codebooks: int = 31
    codebook_size: int = 1024
    latent_dim: int = 512
    # MoG head
    mog_layers: int = 3
    mog_intermediate_size: int = 4608
    mog_components: int = 1024
    mog_rank: int = 64
    log_std_min: float = -4.0
    num_iterations: int = 8
    schedule_exponent: float = 3.0
    # sampling (NeMo's inference defaults: top-p 0.8, noise 0.8) [U]; 0 noise and no Gumbel = deterministic
    top_p: float = 0.8
    noise_scale: float = 0.8
    gumbel: bool = True
    # classifier-free guidance (a second, unconditional stream per slot)
    cfg_scale: float = 0.2
    use_cfg: bool = False
    warmup_positions: int = 37
    speaker: str = "Aria"

    @property
    def layer_types(self) -> tuple[str, ...]:
        """'sliding' or 'global' per backbone layer (transformers' Gemma3 pattern)."""
        p = self.sliding_pattern
        return tuple("global" if (i + 1) % p == 0 else "sliding" for i in range(self.num_layers))

    @model_validator(mode="after")
    def _check(self) -> TalkerConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        if self.char_heads % self.char_kv_heads:
            raise ValueError(
                f"char_kv_heads: {self.char_kv_heads} must divide char_heads ({self.char_heads})"
            )
        ring = min(self.sliding_window, self.attention_window)
        if self.warmup_positions < 2 or self.warmup_positions > ring:
            raise ValueError(
                f"warmup_positions: {self.warmup_positions} must be in [2, {ring}] (the smallest KV ring)"
            )
        if self.mog_rank >= self.latent_dim:
            raise ValueError(f"mog_rank: {self.mog_rank} must be below latent_dim ({self.latent_dim})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        return self


class CodecConfig(_Frozen):
    """RVQ-VAE decoder: codes -> latent -> causal ConvNeXt decoder -> iSTFT head.

    Decoder order throughout (NeMo's `codec_config` lists the encoder's: channels are
    `base_hidden_size * channel_mult` reversed, upsample is `rates` reversed). NeMo fixes the ConvNeXt MLP
    ratio at 4, its LayerNorm eps at 1e-6 and the window at Hann; the release has groups = 1.
    """

    num_codebooks: int = 31
    codebook_size: int = 1024
    latent_dim: int = 512
    channels: tuple[int, ...] = (1536, 768, 384)
    upsample: tuple[int, ...] = (9, 7, 7)
    blocks_per_stage: int = 3
    block_kernel: int = 7
    mlp_ratio: int = 4
    norm_eps: float = 1e-6
    n_fft: int = 16
    hop_length: int = 4

    @property
    def samples_per_frame(self) -> int:
        n = self.hop_length
        for s in self.upsample:
            n *= s
        return n

    @model_validator(mode="after")
    def _check(self) -> CodecConfig:
        if len(self.channels) != len(self.upsample):
            raise ValueError(f"channels: {len(self.channels)} stages but upsample has {len(self.upsample)}")
        if self.n_fft % self.hop_length or (self.n_fft - self.hop_length) % 2:
            raise ValueError(
                f"hop_length: {self.hop_length} must divide n_fft ({self.n_fft}) with n_fft - hop_length even"
            )
        return self


class ModelConfig(_Frozen):
    """The whole model: one preset."""

    name: str
    clock: ClockConfig = Field(default_factory=ClockConfig)
    tokens: TokenConfig = Field(default_factory=TokenConfig)
    thinker: ThinkerConfig = Field(default_factory=ThinkerConfig)
    perception: PerceptionConfig = Field(default_factory=PerceptionConfig)
    talker: TalkerConfig = Field(default_factory=TalkerConfig)
    codec: CodecConfig = Field(default_factory=CodecConfig)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.codec.samples_per_frame != self.clock.output_samples:
            raise ValueError(
                f"codec.upsample: yields {self.codec.samples_per_frame} samples per frame, "
                f"the clock needs {self.clock.output_samples}"
            )
        for field in ("num_codebooks", "codebook_size", "latent_dim"):
            if getattr(self.talker, field) != getattr(self.codec, field):
                raise ValueError(f"talker.{field}: must equal codec.{field}")
        out = self.perception.output_dim
        if out is not None and out != self.thinker.hidden_size:
            raise ValueError(
                f"perception.output_dim: {out} must equal thinker.hidden_size ({self.thinker.hidden_size})"
            )
        return self
