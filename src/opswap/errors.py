"""Exceptions opswap raises. Each message is one sentence a user can act on."""

from __future__ import annotations


class OpswapError(Exception):
    """Base class: anything opswap raises on purpose."""


class SpecError(OpswapError, ValueError):
    """A model spec (zoo:NAME, hf:..., file.py:fn) could not be understood or loaded."""


class CaptureError(OpswapError):
    """A model could not be turned into a graph by FX tracing nor by torch.export."""


class TargetError(OpswapError, ValueError):
    """An unknown hardware target was named."""


class RuleError(OpswapError):
    """A rule could not be found, matched or applied."""


class PlanError(OpswapError, ValueError):
    """A plan file is malformed or does not fit the model it is applied to."""


class VerificationError(OpswapError):
    """Reference and candidate could not be compared (not: they differ)."""


class InputError(OpswapError, ValueError):
    """A call with inputs the optimized or saved model was not made for (another number of
    inputs, rank, dtype, or a size it keeps static)."""


class ExportError(OpswapError):
    """A model could not be exported to a runtime's format (ONNX, ...) or run there."""


class BackendError(OpswapError, ValueError):
    """A backend (the torch.compile backend, a runtime) was given an option it cannot use."""


class CalibrationError(OpswapError, ValueError):
    """Calibration data (the batches static int8 fixes its scales on) could not be read or
    does not fit the model, or a plan's int8 sites have no calibration to be applied with."""
