"""Model definitions that run a ForwardBatch: Kimi Linear, Qwen3-Next, NemotronH."""
