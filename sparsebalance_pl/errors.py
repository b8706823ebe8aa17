"""Errors that end a run with one clear message instead of a traceback (see ``cli.main``)."""

__all__ = ["ConfigError", "DataError", "TrainingError"]


class ConfigError(ValueError):
    """A setting has a value that cannot work; the message names the setting and what is allowed."""


class DataError(ValueError):
    """Input data cannot be used; the message names the file or sample concerned."""


class TrainingError(RuntimeError):
    """Training cannot go on (for example, the loss stayed non-finite); the message says why and where."""
