"""Entry point of the P/D proxy's CLI verb (`kvhal` group): `kvhal proxy`."""
from kvhal.hookspecs import hookimpl


@hookimpl
def kvhal_add_commands(subparsers):
    """Add `kvhal proxy`."""
    from .cli import register
    register(subparsers)
