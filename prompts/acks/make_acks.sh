#!/usr/bin/env bash
# Regenerates the acknowledgement clips the agent plays while a tool runs ("One moment, let me check that").
# 16 kHz mono 16-bit WAV, about 1-1.5 s each; the agent plays them in random order, never one twice in a row.
# Needs espeak-ng and sox (Debian: apt-get install -y espeak-ng sox). Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")"
source ../speak.sh

say() {  # say NAME VOICE SPEED TEXT: NAME.wav
    # leading and trailing silence trimmed, then a short fade so a cut clip does not click, and the level
    # normalised to -3 dBFS
    speak16k "$1.trim" "$2" "$3" "$4" silence 1 0.02 1% reverse silence 1 0.02 1% reverse
    sox -D "$1.trim.wav" "$1.wav" fade t 0.01 "$(soxi -D "$1.trim.wav")" 0.05 gain -n -3
    rm -f "$1.trim.wav"
}

say ack_moment en-us 170 "One moment, let me check that."
say ack_look en-us 170 "Let me look that up for you."
say ack_second en-us 170 "Just a second."
say ack_checking en-us 170 "Sure, checking now."
say ack_bear en-us 165 "Bear with me a moment."
durations ack_*.wav
