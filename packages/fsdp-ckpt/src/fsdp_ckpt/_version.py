"""The package version (read from the installed distribution), importable without importing
the package (the index records it)."""

import importlib.metadata as _metadata

try:  # the version lives in pyproject.toml only
    __version__ = _metadata.version("fsdp-ckpt")
except _metadata.PackageNotFoundError:  # on sys.path without being installed
    __version__ = "0+unknown"
