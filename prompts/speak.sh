# Sourced by the scripts that make the prompts' clips (prompts/acks/make_acks.sh, prompts/callers/make_callers.sh).
# Needs espeak-ng and sox (Debian: apt-get install -y espeak-ng sox).

# speak VOICE SPEED TEXT: espeak-ng's WAV of TEXT in a temporary file, whose path it prints
speak() {
    local tmp
    tmp="$(mktemp --suffix=.wav)"
    espeak-ng -v "$1" -s "$2" -w "$tmp" "$3"
    echo "$tmp"
}

# durations FILE...: each file's length in seconds
durations() {
    for f in "$@"; do soxi -D "$f" | xargs printf "%s %s s\n" "$f"; done
}
