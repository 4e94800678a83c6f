"""The request flow: one generation request from admission through the mesh to its updates."""
