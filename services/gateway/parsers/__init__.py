"""Output parsers: model text -> reasoning, content and tool calls."""
