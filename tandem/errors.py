"""Error types raised for user mistakes. Each message names the field and the fix."""


class TandemError(ValueError):
    """Base class for errors caused by a configuration or request the user gave."""


class ConfigError(TandemError):
    """An engine or model configuration that cannot work."""


class RequestError(TandemError):
    """A request (prompt or sampling parameters) that cannot be served."""
