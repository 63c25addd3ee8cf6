"""One generation engine for GRPO rollouts and eval (see engine.py): static KV slots, CUDA-graph decode,
continuous batching, counter-based sampling noise."""
