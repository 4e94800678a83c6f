"""The pooling worker (`--runner pooling`): the model as an embedder, its batching thread, its Embed servicer and its process."""
