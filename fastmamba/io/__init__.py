"""Reading what a user points at: checkpoint folders, hub ids, tokenizers, prompts."""
