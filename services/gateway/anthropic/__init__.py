"""Anthropic's /v1/messages on top of the chat path: request, answer, events, endpoints."""
