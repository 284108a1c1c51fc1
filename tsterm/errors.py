"""Errors a user can cause. The CLI prints these as one line and exits non-zero, without a traceback."""


class TstermError(Exception):
    """Base of every user-facing error: the message names the file/field/value and what would fix it. `param`: the
    request field it is about, when it is about one (a server answers it as the error's `param`)."""

    exit_code = 1

    def __init__(self, *args: object, param: str | None = None):
        super().__init__(*args)
        self.param = param


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
    """A step of the engine failed for a request (a kernel, the sampler or the detokenizer raised on it): that request
    was failed, the engine goes on serving the others. Its `__cause__` is the original error."""


class ExecutorError(TstermError, RuntimeError):
    """The executor itself is broken (a worker died, the device is gone): no request is to blame and no retry on a
    smaller batch can help, so the engine does not try to isolate a request (`Engine.step` raises it)."""


class EngineTimeoutError(TstermError, TimeoutError):
    """The engine did not answer in time: a step that does not return, or a request that waits without output."""


class DistributedError(ExecutorError):
    """A worker rank of a multi-rank engine died, hung past the timeout or failed: the message names the rank."""
