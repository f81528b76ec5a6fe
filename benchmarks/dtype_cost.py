"""`python -m benchmarks.dtype_cost`: what the talker and the codec would lose in bf16 against their fp32
reference, at a preset's shape with its dummy weights.

Both stages are built in fp32 and in bf16 with the same weights (the bf16 copy is loaded from the fp32 one's
state), fed the same text tokens step by step, each from a fresh state: the talker's audio codes are
compared frame by frame (the share that agree, and the first frame where a slot's differ), and the fp32
codec decodes the fp32 talker's codes against the bf16 codec decoding the same codes (max and mean absolute
difference of the samples, and the SNR). Last line: one JSON object. Knows the two stages; nothing of
sessions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from engine.config.presets import PRESETS, load_preset
from engine.model.codec import Codec
from engine.model.talker import Talker
from engine.text.tokens import Tokens


def _talker(cfg, slots: int, dtype: torch.dtype, like: Talker | None) -> Talker:
    torch.manual_seed(cfg.seed)
    t = Talker(cfg.talker, cfg.tokens.tokenizer, slots, dtype, dtype)
    if like is not None:
        t.load_state_dict(like.state_dict())
    t.refresh()
    t.reset(torch.ones(slots, dtype=torch.bool))
    return t


def measure(preset: str = "tiny", slots: int = 8, steps: int = 50) -> dict:
    cfg = load_preset(preset)
    t32 = _talker(cfg, slots, torch.float32, None)
    t16 = _talker(cfg, slots, torch.bfloat16, t32)
    torch.manual_seed(cfg.seed)
    c32 = Codec(cfg.codec, slots, torch.float32)
    c16 = Codec(cfg.codec, slots, torch.bfloat16)
    c16.load_state_dict(c32.state_dict())
    for c in (c32, c16):
        c.init_buffers()
        c.reset(torch.ones(slots, dtype=torch.bool))
    every = torch.ones(slots, dtype=torch.bool)
    gen = torch.Generator().manual_seed(cfg.seed)
    agree = total = 0
    first_diff = [None] * slots
    pcm32, pcm16 = [], []
    for step in range(steps):
        text = torch.randint(0, Tokens(cfg.tokens).vocab_size, (slots,), generator=gen)
        a, b = t32.step(text, every), t16.step(text, every)
        same = (a == b).all(-1)
        agree += int(same.sum())
        total += slots
        for s in range(slots):
            if first_diff[s] is None and not bool(same[s]):
                first_diff[s] = step
        pcm32.append(c32.step(a, every))
        pcm16.append(c16.step(a, every))
    x, y = torch.cat(pcm32, -1), torch.cat(pcm16, -1).float()
    err = (x - y).abs()
    noise = float((x - y).pow(2).mean())
    return {
        "bench": "dtype_cost",
        "preset": preset,
        "slots": slots,
        "steps": steps,
        "talker_bf16_frames_agree": round(agree / total, 4),
        "talker_bf16_first_diff_frame": first_diff,
        "codec_bf16_max_abs": float(err.max()),
        "codec_bf16_mean_abs": float(err.mean()),
        "codec_bf16_snr_db": round(10 * math.log10(float(x.pow(2).mean()) / noise), 2) if noise else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dtype_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    with torch.inference_mode():
        out = measure(args.preset, args.slots, args.steps)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
