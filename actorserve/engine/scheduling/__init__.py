"""Scheduling data, pure Python (no torch): the engine interface, sequences, parameters, KV block accounting, lanes, batching and priority policy, n-gram drafts."""
