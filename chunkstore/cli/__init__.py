"""The chunkstore command-line interface."""
