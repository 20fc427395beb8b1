"""One error hierarchy for problems a user can cause; the CLI prints them in one line plus a hint."""

from __future__ import annotations


class DFlashError(Exception):
    """A user-facing error: `message` says what is wrong, `hint` what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class RecipeError(DFlashError):
    """Malformed, unknown or invalid recipe."""


class CheckpointError(DFlashError):
    """Missing, truncated or mismatched checkpoint files."""


class CacheError(DFlashError):
    """The artifact cache cannot be used (unwritable, corrupt, missing artifact)."""


class BackendError(DFlashError):
    """A backend (ONNX Runtime provider, QAIC SDK) is unavailable or failed."""


class ExportValidationError(DFlashError):
    """An exported graph disagrees with the PyTorch module beyond tolerance."""


class GenerationError(DFlashError):
    """Bad generation request: empty prompt, over-long prompt, unsupported sampling."""


class DatasetError(DFlashError):
    """Missing, empty or malformed benchmark dataset."""


class LosslessError(DFlashError):
    """Greedy DFlash output differed from plain greedy decoding."""

    exit_code = 3


class ThresholdError(DFlashError):
    """A benchmark floor (--min-speedup / --min-tau) was not met."""

    exit_code = 4


class ServeError(DFlashError):
    """The server cannot start: address in use, missing serving dependencies."""


class EndpointError(DFlashError):
    """A benchmarked server (`dflash bench --endpoint`) misbehaved: a bad reply, a broken stream, no answer."""


class InputVanishedError(CacheError):
    """What a running stage reads (an upstream artifact) or writes (its working directory) was removed."""
