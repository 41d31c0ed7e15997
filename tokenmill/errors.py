"""One exception type per failure a user can cause; the server maps them to HTTP status in one place."""


class TokenmillError(Exception):
    """Base of every error tokenmill raises on purpose."""


class ConfigError(TokenmillError, ValueError):
    """A flag or constructor argument is invalid; the message names the flag to change."""


class ModelLoadError(TokenmillError):
    """A model path is missing, corrupt or of an unsupported architecture."""


class InvalidRequest(TokenmillError, ValueError):
    """A request field is out of range; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    """Prompt plus max_tokens exceed the context window or the KV pool."""


class ServerOverloaded(TokenmillError):
    """The waiting queue is full, or a request's latency target cannot be met now; try again later."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after  # seconds, for the Retry-After header


class ServerBusy(TokenmillError):
    """The engine could not do this request's work in time because it is busy now (a grammar build under load); the
    same request may well succeed later (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after  # seconds, for the Retry-After header


class ParallelFailure(TokenmillError, RuntimeError):
    """A tensor-parallel rank failed, hung or fell out of step: the engine cannot go on (it stops and says so)."""


class RequestFailed(TokenmillError):
    """The engine could not run this request (its step raised); the engine itself goes on."""


class ServerShuttingDown(TokenmillError):
    """The server is stopping and could not finish this request in its shutdown timeout."""
