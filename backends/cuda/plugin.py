"""Entry point of the cuda backend (`kvhal` group)."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import BackendSpec


@hookimpl
def kvhal_register_backends():
    """Register the cuda backend; it is chosen before cpu whenever its probe succeeds."""
    from .backend import CudaBackend
    return [BackendSpec("cuda", CudaBackend, priority=20)]
