"""The model's text: the tokenizer, its special and forced tokens, tool calls' parsing, and the system prompt
with its tool block.

Runs in: either side (a room forces tokens; the tick decodes them). May import: `engine.api` and
`engine.config.stage_config`; never torch.
Imported by: `engine.api`, `engine.client`, `engine.memory`, `engine.model` and `engine.tick`.
"""
