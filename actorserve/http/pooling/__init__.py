"""Pooling routes: embeddings, classify, score, rerank, vLLM's /pooling and /invocations, and Cohere's v2 API."""
