"""Errors the engine raises for things a user can fix."""


class ModelLoadError(ValueError):
    """A model directory is missing, incomplete, or describes a model the engine can't run."""
