"""k25: an embeddable single-node LLM inference engine."""
