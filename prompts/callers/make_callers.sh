#!/usr/bin/env bash
# Regenerates the short caller utterances the simulation plays and the perception tests hear: 16 kHz mono 16-bit WAV, 2-4 s.
# Needs espeak-ng and sox (Debian: apt-get install -y espeak-ng sox). Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")"
source ../speak.sh

# each: leading silence trimmed, 0.2 s of silence padded at both ends
trim=(silence 1 0.02 1% pad 0.2 0.2)
speak16k caller_booking en-us 175 "Hi, I would like to book a double room for two nights." "${trim[@]}"
speak16k caller_question en-gb 160 "Do you have parking at the hotel?" "${trim[@]}"
speak16k caller_cancel en-us+f3 150 "Please cancel my reservation for Friday." "${trim[@]}"
durations caller_*.wav
