"""hybridserve: serving linear-attention hybrid LLMs."""
