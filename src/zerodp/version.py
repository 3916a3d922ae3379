"""The package version, in a module of its own so that library code can read it without
importing the package's ``__init__`` (and everything it re-exports)."""

__version__ = "0.1.0"
