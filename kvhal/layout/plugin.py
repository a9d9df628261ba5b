"""Entry point of the built-in device layouts (`kvhal` group), registered like a third party's."""
from kvhal.hookspecs import hookimpl


@hookimpl
def kvhal_register_layouts():
    """Register the built-in layouts of `kvhal.layout.devices.BUILTIN_LAYOUTS`."""
    from .devices import BUILTIN_LAYOUTS
    return list(BUILTIN_LAYOUTS)
