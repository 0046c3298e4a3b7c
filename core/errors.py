"""Errors a user can cause. The CLI prints them as one line, never a traceback."""


class ServelabError(Exception):
    """A problem with the user's input or set-up, explained in one line."""


class ConfigError(ServelabError):
    """A configuration value that names nothing or is out of range."""


class ModelNotFoundError(ServelabError):
    """The model file or directory is not there."""


class RequestError(ServelabError):
    """A request that cannot be served as given (too long, bad parameter)."""
