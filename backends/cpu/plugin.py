"""Entry point of the cpu backend (`kvhal` group): registers it like any third party would."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import BackendSpec


@hookimpl
def kvhal_register_backends():
    """Register the cpu reference backend at the lowest priority (chosen last)."""
    from .backend import CpuBackend
    return [BackendSpec("cpu", CpuBackend, priority=0)]
