"""Links to the other services: channels, stubs and the data-plane streams."""
