# Sourced by the scripts that make the prompts' clips (prompts/acks/make_acks.sh, prompts/callers/make_callers.sh).
# Needs espeak-ng and sox (Debian: apt-get install -y espeak-ng sox).

# speak VOICE SPEED TEXT: espeak-ng's WAV of TEXT in a temporary file, whose path it prints
speak() {
    local tmp
    tmp="$(mktemp --suffix=.wav)"
    espeak-ng -v "$1" -s "$2" -w "$tmp" "$3"
    echo "$tmp"
}

# speak16k NAME VOICE SPEED TEXT EFFECT...: NAME.wav, TEXT spoken and made 16 kHz mono 16-bit with sox's
# EFFECTs applied
speak16k() {
    local wav name="$1"
    wav="$(speak "$2" "$3" "$4")"
    shift 4
    sox -D "$wav" -r 16000 -c 1 -b 16 "$name.wav" "$@"
    rm -f "$wav"
}

# durations FILE...: each file's length in seconds
durations() {
    for f in "$@"; do soxi -D "$f" | xargs printf "%s %s s\n" "$f"; done
}
