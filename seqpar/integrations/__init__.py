"""Integrations with the frameworks users train in (``huggingface``: transformers' AttentionInterface)."""
