"""Errors a user can cause. The CLI prints these as one line and exits non-zero, without a traceback."""


class TstermError(Exception):
    """Base of every user-facing error: the message names the file/field/value and what would fix it."""

    exit_code = 1


class ConfigError(TstermError, ValueError):
    """A bad option, profile or sampling parameter (exit code 2: usage/config)."""

    exit_code = 2


class ModelLoadError(TstermError):
    """A model directory that cannot be loaded: missing/extra tensors, bad shapes, unknown model_type."""


class RequestError(TstermError, ValueError):
    """A request that cannot be served as given (prompt too long, can never fit in the KV cache)."""


class EngineStoppedError(TstermError, RuntimeError):
    """The engine's thread has stopped (shut down, or an unexpected error): pending and new requests fail with it."""


class EngineStepError(TstermError, RuntimeError):
    """A step of the engine failed (a bug, a device error): the requests in it were aborted, the engine goes on. Its
    `__cause__` is the original error."""


class EngineTimeoutError(TstermError, TimeoutError):
    """The engine did not answer in time: a step that does not return, or a request that waits without output."""


class DistributedError(TstermError, RuntimeError):
    """A worker rank of a multi-rank engine died, hung past the timeout or failed: the message names the rank."""
