"""The encoder engine (embeddings, classifiers) and the pooling heads."""
