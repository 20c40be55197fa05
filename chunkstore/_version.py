"""The package version, read by the build and by `chunkstore --version`."""

__version__ = "0.1.0"
