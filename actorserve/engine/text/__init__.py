"""Tokens and text: the tokenizer and streaming detokenization."""
