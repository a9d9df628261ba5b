"""Probing a vendor runtime: can it run here, and if not, exactly why. Never raises."""
from __future__ import annotations

import importlib
import re
from typing import Any

from kvhal.hal import Availability

from .errors import Errors, code_of
from .vendor import VendorTable


def import_binding(table: VendorTable) -> Any:
    """Import the vendor's binding module, `package.module` or `package:attribute` (hip-python
    exposes `hip.hip` as an attribute of `hip`). Raises ImportError if it is missing."""
    path, _, attr = table.module.partition(":")
    module = importlib.import_module(path)
    if attr and not hasattr(module, attr):
        raise ImportError(f"{path} has no attribute {attr!r}")
    return getattr(module, attr) if attr else module


def error_enum(table: VendorTable, module: Any) -> Any:
    """The binding's error enum class."""
    return getattr(module, table.error_enum())


def _call_text(module: Any, table: VendorTable, op: str) -> str:
    """`op`'s integer result as vendor version text, or '?' if the call fails."""
    try:
        err, value = getattr(module, table.api(op))()
        return table.version_text(int(value)) if code_of(err) == 0 else "?"
    except Exception:  # noqa: BLE001 - probing only
        return "?"


def _error_text(module: Any, table: VendorTable, err: Any) -> str:
    """The runtime's own description of `err` (`*GetErrorString`), or '' if unavailable."""
    try:
        result = getattr(module, table.api("error_string"))(err)
        text = result[-1] if isinstance(result, tuple) else result
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - probing only
        return ""


def _without_bytes_reprs(text: str) -> str:
    """`text` with Python bytes reprs (`b'libamdhip64.so'`) replaced by their contents:
    hip-python formats its dlopen error from bytes ("failed to dlopen 'b'libamdhip64.so''")."""
    return _BYTES_REPR.sub(lambda m: m.group(1), text)


_BYTES_REPR = re.compile(r"""b'([^']*)'""")


def probe(table: VendorTable) -> Availability:
    """Whether `table`'s runtime can run here: binding importable, library loadable, driver
    present, ≥ 1 device. The reason names the failing step, the vendor error and the fix.

    Never raises; side effects are those of the vendor's own device-count call (loading its
    library).
    """
    try:
        module = import_binding(table)
    except Exception as exc:  # noqa: BLE001 - ImportError and anything a broken install raises
        return Availability(False, f"{table.package} is not importable ({exc.__class__.__name__}: "
                                   f"{exc}); install kvhal's {table.extra!r} extra")
    api = table.api("get_device_count")
    try:
        result = getattr(module, api)()
    except Exception as exc:  # noqa: BLE001 - hip-python raises RuntimeError without the library
        return Availability(False, f"{api} raised {exc.__class__.__name__}: "
                                   f"{_without_bytes_reprs(str(exc))}")
    try:
        errors = Errors(table, error_enum(table, module))
        code = code_of(result[0])
        if code != errors.success:
            versions = (f"runtime {_call_text(module, table, 'runtime_version')}, driver "
                        f"{_call_text(module, table, 'driver_version')}")
            return Availability(False, f"{api} returned {errors.name(code)} ({code}): "
                                       f"{_error_text(module, table, result[0])}; {versions}")
        count = int(result[1])
    except Exception as exc:  # noqa: BLE001 - an unexpected binding shape is a reason, not a crash
        return Availability(False, f"{api} gave an unexpected result {result!r}: {exc}")
    if count < 1:
        return Availability(False, f"{api} found no devices")
    return Availability(True)
