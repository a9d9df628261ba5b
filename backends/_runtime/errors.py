"""Vendor error codes -> the kvhal.hal error hierarchy.

Both bindings return a tuple `(err, *values)` from every runtime call; `Errors.check` unwraps
it, and turns a non-success `err` into the HAL error class the vendor table assigns to it (a
code no table lists becomes a plain `HalError`), carrying backend, code and API name.
"""
from __future__ import annotations

from typing import Any

from kvhal.hal import HalError

from .vendor import ERROR_CLASSES, VendorTable


def code_of(err: Any) -> int:
    """The integer value of a vendor error enum member (or of a plain int)."""
    return int(getattr(err, "value", err))


class Errors:
    """Error mapping for one vendor, resolved against its binding's error enum.

    Args:
        table: The vendor table.
        enum: The binding's error enum class (`cudaError_t`, `hipError_t`).
    """

    def __init__(self, table: VendorTable, enum: Any):
        self.table = table
        self.enum = enum
        self.success = code_of(getattr(enum, table.prefix + "Success"))
        self.not_ready = code_of(getattr(enum, table.prefix + "ErrorNotReady"))
        self.classes: dict[int, type[HalError]] = {}
        for cls, suffixes in ERROR_CLASSES.items():
            for suffix in suffixes:
                member = getattr(enum, table.prefix + suffix, None)
                if member is not None:
                    self.classes.setdefault(code_of(member), cls)

    def name(self, code: int) -> str:
        """Enum member name of `code`, or 'unknown error <code>'."""
        try:
            return self.enum(code).name
        except ValueError:
            return f"unknown error {code}"

    def error(self, code: int, api: str, message: str = "") -> HalError:
        """The HAL error for vendor `code` returned by `api` (not raised)."""
        cls = self.classes.get(code, HalError)
        text = f"{api} failed: {self.name(code)}" + (f": {message}" if message else "")
        return cls(text, backend=self.table.backend, code=code, api=api)

    def check(self, result: Any, api: str, message: str = "") -> Any:
        """Unwrap a binding result: None for `(err,)`, the value for `(err, v)`, else a tuple.

        Raises:
            HalError (subclass per `ERROR_CLASSES`): err is not success.
        """
        if not isinstance(result, tuple):
            result = (result,)
        code = code_of(result[0])
        if code != self.success:
            raise self.error(code, api, message)
        values = result[1:]
        if not values:
            return None
        return values[0] if len(values) == 1 else values
