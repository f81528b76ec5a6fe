"""Build the tiny preset's tokenizer (engine/config/assets/tiny_tokenizer.json).

A byte-level BPE with the Nano-9B-v2 tokenizer's special-token layout: ids 0..31 are `<unk>`, `<s>`,
`</s>` and `<SPECIAL_3>`..`<SPECIAL_31>` (PAD is `<SPECIAL_12>`, tool-call start/end `<SPECIAL_20>`,
`<SPECIAL_21>`, end of tool response `<SPECIAL_22>`). Every character of every token is itself a
token (the talker's character encoder needs that). Deterministic: rerun to regenerate.
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
SPECIALS = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 32)]

CORPUS = [
    "Hello, thank you for calling the Grand Harbor Hotel. How can I help you today?",
    "I would like to book a room for two nights, checking in on the twelfth of March.",
    "We have standard, deluxe and suite rooms available. Which would you prefer?",
    "Could I have your full name and a phone number or email, please?",
    "Your confirmation code is ready. Is there anything else I can help you with?",
    "One moment, let me check that for you. Breakfast is served from seven to ten.",
    "Parking is available on site. Check-in is at three and check-out at eleven.",
    "I'm sorry, no deluxe rooms are left on the twelfth; a standard room is.",
    "Cancellations are free up to forty-eight hours before arrival.",
    '<TOOLCALL>[{"name": "check_availability", "arguments": {"check_in": "2026-12-12", '
    '"check_out": "2026-12-14", "guests": 2, "room_type": "deluxe"}}]</TOOLCALL>',
    '<TOOLCALL>[{"name": "book_room", "arguments": {"guest_name": "Ada Lovelace", '
    '"contact": "+1 555 0100", "room_type": "standard"}}]</TOOLCALL>',
    '<TOOL_RESPONSE>[{"available": true, "room_type": "standard", "nightly_rate_cents": 18900, '
    '"total_cents": 41580, "confirmation_code": "K7Q2M9"}]</TOOL_RESPONSE>',
    '<AVAILABLE_TOOLS>[{"type": "function", "function": {"name": "lookup_reservation", '
    '"description": "Find a reservation", "parameters": {"type": "object", '
    '"properties": {}, "required": []}}}]</AVAILABLE_TOOLS>',
    "You are the concierge of a hotel. Speak briefly, one question at a time, and read names back.",
    "0123456789 yes no okay sure great perfect what when where which who why how many",
]


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "engine" / "config" / "assets" / "tiny_tokenizer.json"
    tok = build()
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, name in enumerate(SPECIALS):
        assert tok.token_to_id(name) == i, name
    tok.save(str(out))
    print(f"wrote {out} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
