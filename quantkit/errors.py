"""User-facing error types: each message names the bad input and says how to fix it."""


class QuantkitError(Exception):
    """Base class for errors caused by user input; the CLI prints them without a traceback."""


class RecipeError(QuantkitError):
    """A recipe file, preset name or --set override is invalid."""


class ModelNotFoundError(QuantkitError):
    """A MODEL argument names no local directory, cached demo model or reachable hub repo."""


class UnsupportedArchitectureError(QuantkitError):
    """The model's architecture has no registered adapter."""


class CheckpointError(QuantkitError):
    """A checkpoint on disk is missing files, corrupted, truncated or of an unknown format."""


class CalibrationDataError(QuantkitError):
    """Calibration or evaluation text is missing, unreadable or too short."""


class PluginError(QuantkitError):
    """A plugin failed to import or registered something invalid."""


class OutputExistsError(QuantkitError):
    """The output directory exists and --overwrite was not given."""


class QuantizationError(QuantkitError):
    """A model cannot be quantized with the requested scheme (e.g. group size does not divide)."""


class UnknownNameError(QuantkitError, KeyError):
    """A registry lookup (algorithm, format, architecture) found no such name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class KernelError(QuantkitError):
    """A kernel was forced (QUANTKIT_KERNEL) where it cannot run, or the variable names no kernel."""


class ContextLengthError(QuantkitError, ValueError):
    """A calibration, evaluation or request length is longer than the model's context."""


class IncompatibleModelsError(QuantkitError, ValueError):
    """Two models that must agree (a draft and its target, models scored against each other) do not."""


class KVCapacityError(QuantkitError, ValueError):
    """A request needs more KV-cache tokens than the engine's whole pool holds."""
