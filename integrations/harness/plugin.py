"""Entry point of the test harness's CLI verbs (`kvhal` group): `kvhal demo`, `kvhal replay`,
`kvhal soak` and `kvhal bench ...`."""
from kvhal.hookspecs import hookimpl


@hookimpl
def kvhal_add_commands(subparsers):
    """Add the harness's verbs."""
    from . import bench, cli, soak
    from .vllm import demo
    for module in (bench, cli, demo, soak):
        module.register(subparsers)
