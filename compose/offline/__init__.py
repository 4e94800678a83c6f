"""In-process generation: the engine and the tokenizer's text side in one process (run-batch)."""
