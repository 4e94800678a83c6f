"""Multi-LoRA serving in the worker: adapter weights, device slots, the per-step batch."""
