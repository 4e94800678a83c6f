"""Structured outputs: grammars compiled per request and a matcher per sequence, admitted through the engine's step hooks."""
