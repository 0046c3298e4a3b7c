"""Errors a user can cause. The CLI prints them as one line, never a traceback."""


class ServelabError(Exception):
    """A problem with the user's input or set-up, explained in one line."""


class ConfigError(ServelabError):
    """A configuration value that names nothing or is out of range."""


class ModelNotFoundError(ServelabError):
    """The model file or directory is not there."""


class RequestError(ServelabError):
    """A request that cannot be served as given (too long, bad parameter)."""


class DeadlineError(RequestError):
    """Load shedding: the request would miss its TTFT target given the queue, so it is refused now."""

    def __init__(self, message: str, predicted_ttft_s: float, target_s: float) -> None:
        super().__init__(message)
        self.predicted_ttft_s, self.target_s = predicted_ttft_s, target_s

    @property
    def retry_after_s(self) -> int:
        """When the queue ahead should have drained enough (whole seconds, at least 1)."""
        import math

        return max(1, math.ceil(self.predicted_ttft_s - self.target_s))
