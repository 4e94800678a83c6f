"""The KV tier: computed blocks saved to, and prompt blocks loaded from, the kvstore, through the engine's step hooks."""
