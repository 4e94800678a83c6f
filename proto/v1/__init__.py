"""Generated code of the meshserve.v1 contract; regenerate with `python -m meshserve.proto.generate`."""
