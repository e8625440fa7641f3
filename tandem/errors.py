"""Error types: user mistakes (TandemError; each message names the field and the fix), and an
engine step that failed (StepError)."""


class TandemError(ValueError):
    """Base class for errors caused by a configuration or request the user gave."""


class ConfigError(TandemError):
    """An engine or model configuration that cannot work."""


class RequestError(TandemError):
    """A request (prompt or sampling parameters) that cannot be served."""


class ContextLengthError(RequestError):
    """A prompt that leaves no room to generate within max_model_len (the server's
    context_length_exceeded)."""


class StepError(RuntimeError):
    """An engine step failed (out of GPU memory, or a bug) and ended the requests it ran.

    request_ids names them (None: it failed while planning, before it ran any); requests the step
    did not run are untouched and the engine stays usable, unless fatal: a device error left the
    GPU unusable, and the process must be restarted. The message says what to change when the
    cause was a setting (out of memory)."""

    def __init__(self, message: str, request_ids: list[str] | None, fatal: bool = False):
        super().__init__(message)
        self.request_ids = request_ids
        self.fatal = fatal
