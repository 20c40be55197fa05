"""Subcommands of ``chunkstore``: one module each, discovered by ``cli.main``."""
