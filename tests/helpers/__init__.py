"""Shared fixture builders for tests (tokenizer directories, tiny checkpoints)."""
