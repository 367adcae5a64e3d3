"""The package version (a leaf module: the cost table's fingerprint reads it)."""

__version__ = "0.1.0"
