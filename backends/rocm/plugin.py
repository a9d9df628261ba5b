"""Entry point of the rocm backend (`kvhal` group)."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import BackendSpec


@hookimpl
def kvhal_register_backends():
    """Register the rocm backend; it is chosen before cpu whenever its probe succeeds."""
    from .backend import RocmBackend
    return [BackendSpec("rocm", RocmBackend, priority=10)]
