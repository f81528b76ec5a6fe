"""The model's text, either side's: the tokenizer, its special and forced tokens, and the system prompt with
its tool block.
"""
