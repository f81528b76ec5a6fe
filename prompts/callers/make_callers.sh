#!/usr/bin/env bash
# Regenerates the short caller utterances the simulation plays and the perception tests hear: 16 kHz mono 16-bit WAV, 2-4 s.
# Needs espeak-ng and sox (Debian: apt-get install -y espeak-ng sox). Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")"
source ../speak.sh

utter() {  # utter NAME VOICE SPEED TEXT: NAME.wav
    local wav
    wav="$(speak "$2" "$3" "$4")"
    # resample to 16 kHz mono 16-bit, trim leading silence, pad 0.2 s of silence at both ends
    sox -D "$wav" -r 16000 -c 1 -b 16 "$1.wav" silence 1 0.02 1% pad 0.2 0.2
    rm -f "$wav"
}

utter caller_booking en-us 175 "Hi, I would like to book a double room for two nights."
utter caller_question en-gb 160 "Do you have parking at the hotel?"
utter caller_cancel en-us+f3 150 "Please cancel my reservation for Friday."
durations caller_*.wav
