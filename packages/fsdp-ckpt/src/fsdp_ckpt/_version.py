"""The package version, importable without importing the package (the index records it)."""

__version__ = "0.1.0"
