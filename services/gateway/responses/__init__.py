"""OpenAI's /v1/responses on top of the chat path: request, answer, events, store, endpoints."""
