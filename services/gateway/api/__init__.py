"""The HTTP API: the OpenAI and vLLM endpoints, their middlewares and response rendering."""
