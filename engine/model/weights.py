"""Loading a release checkpoint (`model.safetensors` in NVIDIA's naming) into the pipeline's stages.

Each stage names its tensors as the release does (less a prefix); `targets` joins those name tables into one
map, release name -> our tensor. A load checks the whole file against it first (missing, unexpected and
misshapen tensors, before a byte of weights is read), then streams the file one tensor at a time in file
order, in chunks: each chunk is read through the memory map, cast to its stage's dtype on its way to the
device, and its pages handed back, so the process never holds more than the model plus one chunk. Knows file
layout, stage prefixes and sizes; knows nothing of slots or time.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from engine.config.stage_config import ModelConfig, TalkerConfig, TokenConfig
from engine.model import codec, perception, talker, thinker
from engine.model.checkpoint import CheckpointError, SafetensorsFile, TensorInfo, weights_path
from engine.model.release_config import check_release_config, read_release_config

__all__ = ["CheckpointError", "load_checkpoint", "load_into", "model_config", "read_tensors", "resolve"]

log = logging.getLogger("chorus.weights")

# Release tensors that inference does not use, by prefix: the user-transcript (RNNT) branch.
UNUSED_PREFIXES = ("stt_model.rnnt_decoder.", "stt_model.rnnt_joint.")
SPEAKER_PREFIX = "tts_model.audio_prompt_latents."
# Talker tensors the tokenizer determines (built from it by the talker, compared with the checkpoint's).
TOKENIZER_DERIVED = tuple(
    talker.PREFIX + "embed_subword." + n
    for n in (
        "subword_flag_emb.is_continuation",
        "subword_flag_emb.pad_tensor",
        "bos_eos_emb.special_flags",
        "bos_eos_emb.pad_tensor",
    )
)
FRONT_END = tuple(perception.RELEASE_PREFIX + n for n in perception._FRONT_END_BUFFERS)
CHUNK_BYTES = 64 * 2**20  # mapped bytes resident at once while copying a large tensor

resolve = weights_path


# ---------------------------------------------------------------------- the name table


def targets(pipeline: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """Release name -> (our qualified name, our tensor) for every tensor the stages read."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for k, t in pipeline.thinker.state_dict(keep_vars=True).items():
        out[thinker.RELEASE_PREFIX + k] = (f"thinker.{k}", t)
    own = pipeline.perception.state_dict(keep_vars=True)
    for k, rel in perception.release_names(pipeline.perception).items():
        out[rel] = (f"perception.{k}", own[k])
    extra = {v.format(speaker=pipeline.talker.cfg.speaker): k for k, v in talker.EXTRA_NAMES.items()}
    for rel, t in pipeline.talker.release_names().items():
        out[rel] = (f"talker.{extra.get(rel, rel.removeprefix(talker.PREFIX))}", t)
    for k, t in pipeline.codec.state_dict(keep_vars=True).items():
        out[codec.PREFIX + k] = (f"codec.{k}", t)
    return out


def is_ignored(name: str) -> bool:
    """A release tensor inference deliberately does not read (the RNNT branch, the codec's encoder...)."""
    return (
        name.startswith(UNUSED_PREFIXES)
        or name in perception.IGNORED_RELEASE_NAMES
        or bool(codec.ignored_release_names({name: None}))  # type: ignore[dict-item]
        or any(p.fullmatch(name) for p in talker.IGNORED)
    )


def speakers(names: Any) -> list[str]:
    """The speaker latents a checkpoint offers (`tts_model.audio_prompt_latents.<Name>`)."""
    return sorted(n.removeprefix(SPEAKER_PREFIX) for n in names if n.startswith(SPEAKER_PREFIX))


def stage_of(name: str) -> str:
    """The stage a release tensor belongs to: "perception", "codec", "talker" or "thinker"."""
    if name.startswith(perception.RELEASE_PREFIX):
        return "perception"
    if name.startswith(codec.PREFIX):
        return "codec"
    return "talker" if name.startswith("tts_model.") else "thinker"


def _expected_shape(name: str, ours: torch.Tensor) -> tuple[int, ...]:
    # the release stores a speaker latent as [1, positions, hidden]
    return (1, *ours.shape) if name.startswith(SPEAKER_PREFIX) else tuple(ours.shape)


def _first(items: list[str], n: int, sep: str) -> str:
    """The first `n` of `items` joined by `sep`, and " ..." when there are more."""
    return sep.join(items[:n]) + (" ..." if len(items) > n else "")


def plan(pipeline: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, torch.Tensor]]:
    """Check a checkpoint's names and shapes against the stages; the map to load by. CheckpointError names
    every missing tensor (by stage), the first misshapen ones with both shapes, and the unexpected ones."""
    table = targets(pipeline)
    problems: list[str] = []
    latent = talker.EXTRA_NAMES["speaker_latent"].format(speaker=pipeline.talker.cfg.speaker)
    if latent not in shapes and speakers(shapes):
        problems.append(
            f"speaker {pipeline.talker.cfg.speaker!r} is not in the checkpoint; it has "
            f"{', '.join(speakers(shapes))} (set CHORUS_SPEAKER or --speaker)"
        )
    missing: dict[str, list[str]] = {}
    for name in table:
        if name not in shapes and not (name == latent and problems):
            missing.setdefault(stage_of(name), []).append(name)
    for stage, names in missing.items():
        problems.append(f"missing {len(names)} tensors the {stage} needs: {_first(names, 8, ', ')}")
    wrong = [
        f"{name} {list(shapes[name])} (the {stage_of(name)} expects {list(_expected_shape(name, t))})"
        for name, (_, t) in table.items()
        if name in shapes and tuple(shapes[name]) != _expected_shape(name, t)
    ]
    if wrong:
        problems.append(f"{len(wrong)} tensors of the wrong shape: {_first(wrong, 5, '; ')}")
    unknown = sorted(n for n in shapes if n not in table and not is_ignored(n))
    if unknown:
        problems.append(f"{len(unknown)} tensors no stage knows: {_first(unknown, 8, ', ')}")
    if problems:
        raise CheckpointError("checkpoint does not fit the model: " + "; ".join(problems))
    return table


# ---------------------------------------------------------------------- progress


class Progress:
    """Tensors and bytes done, rate and time left: a line rewritten in place on a terminal, else a log line
    every ~10% (or `log_every_s`)."""

    def __init__(
        self,
        tensors: int,
        total_bytes: int,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_every_s: float = 10.0,
    ) -> None:
        self.tensors, self.total = tensors, max(1, total_bytes)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock, self.every = clock, log_every_s
        self.t0 = self._shown = clock()
        self.done_tensors = self.done_bytes = 0
        self._next_share = 0.1

    def line(self) -> str:
        dt = max(self.clock() - self.t0, 1e-9)
        rate = self.done_bytes / dt
        left = (self.total - self.done_bytes) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f} s" if left != float("inf") else "?"
        return (
            f"loading weights: {self.done_tensors}/{self.tensors} tensors, "
            f"{self.done_bytes / 2**30:.2f}/{self.total / 2**30:.2f} GiB, "
            f"{rate / 2**20:.0f} MiB/s, {eta} left"
        )

    def advance(self, tensors: int, nbytes: int) -> None:
        self.done_tensors += tensors
        self.done_bytes += nbytes
        now = self.clock()
        if self.tty:
            if now - self._shown >= 0.1 or self.done_tensors == self.tensors:
                self.stream.write("\r" + self.line())
                self.stream.flush()
                self._shown = now
        elif self.done_bytes / self.total >= self._next_share or now - self._shown >= self.every:
            log.info("%s", self.line())
            self._next_share = self.done_bytes / self.total + 0.1
            self._shown = now

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
        log.info("%s", self.line().replace("loading weights:", "loaded weights:"))


# ---------------------------------------------------------------------- loading


@dataclass
class LoadReport:
    consumed: set[str] = field(default_factory=set)  # release names read into (or checked against) a stage
    ignored: set[str] = field(default_factory=set)  # release names deliberately not read
    placed: dict[str, str] = field(default_factory=dict)  # release name -> our qualified tensor name
    nbytes: int = 0  # bytes of the checkpoint's tensors read
    speakers: list[str] = field(default_factory=list)


class _Tensors:
    """An in-memory state dict seen as a checkpoint file (tests, the stage fixtures)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._t = tensors
        self.tensors = {
            k: TensorInfo(v.dtype, tuple(v.shape), 0, v.numel() * v.element_size())
            for k, v in tensors.items()
        }

    def view(self, name: str) -> torch.Tensor:
        return self._t[name]

    def drop(self, start: int, end: int) -> None:
        pass


@torch.no_grad()
def _copy(source: Any, name: str, dest: torch.Tensor) -> None:
    """Copy one tensor into `dest` (its dtype, its device) in chunks, handing each chunk's pages back."""
    src = source.view(name).reshape(-1)
    out = dest.view(-1)
    info = source.tensors[name]
    step = max(1, CHUNK_BYTES // max(1, src.element_size()))
    for a in range(0, src.numel(), step):
        b = min(a + step, src.numel())
        out[a:b].copy_(src[a:b])
        source.drop(info.start + a * src.element_size(), info.start + b * src.element_size())
    del src


@torch.no_grad()
def _load(pipeline: Any, source: Any, progress: Progress | None = None) -> LoadReport:
    shapes = {k: v.shape for k, v in source.tensors.items()}
    table = plan(pipeline, shapes)
    report = LoadReport(speakers=speakers(shapes))
    report.ignored = {k for k in shapes if k not in table}
    meta = any(t.is_meta for _, t in table.values())
    order = sorted(table, key=lambda k: source.tensors[k].start)
    total = sum(source.tensors[k].nbytes for k in order)
    progress = progress or Progress(len(order), total)
    flag_mismatch: list[str] = []
    for name in order:
        qual, dest = table[name]
        report.placed[name] = qual
        report.consumed.add(name)
        nbytes = source.tensors[name].nbytes
        if not meta:
            if name in TOKENIZER_DERIVED:
                theirs = source.view(name).reshape(dest.shape).to(dest.device, dest.dtype)
                if not torch.equal(theirs, dest):
                    flag_mismatch.append(f"{name} ({int((theirs != dest).sum())} ids differ)")
            elif name in FRONT_END:
                theirs = source.view(name).to(dest.device, dest.dtype)
                if not torch.allclose(theirs, dest, rtol=1e-4, atol=1e-6):
                    raise CheckpointError(
                        f"checkpoint: {name} differs from the configured front end (max abs diff "
                        f"{float((theirs - dest).abs().max()):.3g}); check n_fft / win_length / n_mels"
                    )
                dest.copy_(theirs)
            else:
                _copy(source, name, dest)
        report.nbytes += nbytes
        progress.advance(1, nbytes)
    progress.finish()
    if flag_mismatch:
        log.warning(
            "the tokenizer's subword flags differ from the checkpoint's (a different tokenizer than the "
            "one the model was trained with?): %s; using the tokenizer's",
            "; ".join(flag_mismatch),
        )
    if not meta:
        _finish(pipeline)
    return report


def _finish(pipeline: Any) -> None:
    """The checks and derived tensors that need the loaded values."""
    tk = pipeline.talker
    pad = int(tk.control_codes[2])
    if pad != tk.cfg.codebook_size:
        raise CheckpointError(
            f"checkpoint: tts_model._control_codes has speech pad id {pad}, the talker expects "
            f"{tk.cfg.codebook_size} (the masked code)"
        )
    tk.refresh()
    tk.reset(torch.ones(tk.num_slots, dtype=torch.bool, device=tk.pos.device))
    pipeline.codec.init_buffers()


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (small) checkpoint in memory, as stored."""
    with SafetensorsFile(path) as f:
        return {k: f.view(k).clone() for k in f.tensors}


def load_into(pipeline: Any, tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """Load an in-memory release state dict into every stage; the names consumed."""
    return _load(pipeline, _Tensors(tensors)).consumed


def load_checkpoint(pipeline: Any, path: str | Path, progress: Progress | None = None) -> LoadReport:
    """Stream `model.safetensors` into the stages (dry run when they are on the meta device)."""
    with SafetensorsFile(path) as f:
        report = _load(pipeline, f, progress)
    log.info(
        "loaded %d tensors (%.2f GiB) from %s; %d not used; speakers: %s",
        len(report.consumed),
        report.nbytes / 2**30,
        f.path,
        len(report.ignored),
        ", ".join(report.speakers) or "none",
    )
    return report


# ---------------------------------------------------------------------- the run's model config


def tokenizer_file(path: str | Path) -> Path:
    """A tokenizer.json, or a folder holding one (the Nano-9B-v2 download)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise CheckpointError(f"tokenizer: no tokenizer.json at {str(path)!r}")
    return p


def model_config(
    preset: ModelConfig,
    checkpoint: str | Path | None = None,
    tokenizer: str | Path | None = None,
    speaker: str | None = None,
) -> ModelConfig:
    """The preset with the run's tokenizer and speaker, checked against the checkpoint's config.json.

    With a tokenizer, the talker's character vocabulary is the tokenizer's single-character tokens (NeMo's
    `build_vocabs`); the checkpoint's character embedding must then have as many rows (checked on load)."""
    tokens: TokenConfig = preset.tokens
    tk: TalkerConfig = preset.talker
    if tokenizer is not None:
        path = tokenizer_file(tokenizer)
        from tokenizers import Tokenizer

        try:
            vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
        except Exception as e:  # noqa: BLE001 (tokenizers raises its own exception type)
            raise CheckpointError(f"tokenizer: cannot load {str(path)!r}: {e}") from None
        for field_name in ("bos", "eos", "pad", "tool_call_start", "tool_call_end", "tool_response_end"):
            s = getattr(tokens, field_name)
            if s not in vocab:
                raise CheckpointError(
                    f"tokenizer: special token {s!r} ({field_name}) is not in {str(path)!r}"
                )
        tokens = tokens.model_copy(update={"tokenizer": str(path)})
        tk = tk.model_copy(update={"char_vocab_size": sum(len(s) == 1 for s in vocab)})
    if speaker:
        tk = tk.model_copy(update={"speaker": speaker})
    cfg = ModelConfig.model_validate(
        {**preset.model_dump(), "tokens": tokens.model_dump(), "talker": tk.model_dump()}
    )
    if checkpoint is not None:
        raw = read_release_config(checkpoint)
        if raw is not None:
            check_release_config(raw, cfg)
        else:
            log.warning("checkpoint %s: no config.json beside it; checked by tensor shapes only", checkpoint)
    return cfg
