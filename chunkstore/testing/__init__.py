"""Test support shipped with the package: chunk factories and the store conformance suite."""
