"""Logits to tokens: sampling, penalties, grammar masks, the thinking budget, prompt logprobs."""
