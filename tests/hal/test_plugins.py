"""Plugin registry: built-ins arrive by entry points; selection; third-party pickup."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvhal import plugins
from kvhal.hal import BackendUnavailableError
from kvhal.hookspecs import hookimpl

REPO = Path(__file__).resolve().parents[2]


def test_builtins_registered_in_priority_order():
    assert list(plugins.backends()) == ["cuda", "rocm", "cpu"]


def test_auto_selection_falls_back_to_cpu_here(monkeypatch):
    monkeypatch.delenv(plugins.BACKEND_ENV, raising=False)
    assert plugins.select_backend().name == "cpu"


def test_env_selects_backend(monkeypatch):
    monkeypatch.setenv(plugins.BACKEND_ENV, "cuda")
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' is unavailable"):
        plugins.select_backend()


def test_unknown_backend_lists_registered():
    with pytest.raises(plugins.PluginError, match="registered: cuda, rocm, cpu"):
        plugins.select_backend("tpu")


TOY_MODULE = '''
from kvhal.backends.cpu import CpuBackend
from kvhal.hookspecs import hookimpl
from kvhal.plugins import BackendSpec


class ToyBackend(CpuBackend):
    name = "toy"


@hookimpl
def kvhal_register_backends():
    return [BackendSpec("toy", ToyBackend, priority=5)]
'''

TOY_PYPROJECT = '''
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "kvhal-toy-backend"
version = "0.0.1"

[project.entry-points.kvhal]
toy = "kvhal_toy_backend"

[tool.setuptools]
py-modules = ["kvhal_toy_backend"]
'''


@pytest.mark.slow
def test_third_party_backend_runs_the_conformance_suite(tmp_path):
    """pip-install a throwaway backend package; the conformance suite picks it up by name."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text(TOY_PYPROJECT)
    (pkg / "kvhal_toy_backend.py").write_text(textwrap.dedent(TOY_MODULE))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(pkg)], check=True)
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", str(REPO / "conformance"), "--kvhal-backend=toy",
                          "-k", "hal and not 2d"], cwd=REPO, env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[toy" in out.stdout or "passed" in out.stdout
    assert " passed" in out.stdout and " failed" not in out.stdout


class _Plugin:
    """An in-process plugin whose `kvhal_register_backends` returns `specs` as given."""

    def __init__(self, specs):
        self.specs = specs

    @hookimpl
    def kvhal_register_backends(self):
        return self.specs


@pytest.mark.parametrize("specs, message", [
    ([plugins.BackendSpec("cpu", object)],
     "backend 'cpu' is registered twice, by plugins 'odd' and 'cpu'"),
    (["cpu2"], "plugin 'odd': kvhal_register_backends returned 'cpu2', not a BackendSpec"),
    (plugins.BackendSpec("single", object),
     "plugin 'odd': kvhal_register_backends must return a list of backend specs, got "
     "BackendSpec"),
])
def test_bad_registration_names_the_plugin(specs, message):
    pm = plugins.plugin_manager()
    plugin = _Plugin(specs)
    pm.register(plugin, name="odd")
    try:
        with pytest.raises(plugins.PluginError) as info:
            plugins.backends()
        assert str(info.value).startswith(message)
    finally:
        pm.unregister(plugin)
    assert list(plugins.backends()) == ["cuda", "rocm", "cpu"]


def test_conformance_suite_refuses_an_unknown_backend_name_in_one_line():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", str(REPO / "conformance"), "--kvhal-backend=nope"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout[-2000:]
    assert ("--kvhal-backend: 'nope' not registered; registered: cuda, rocm, cpu"
            in out.stderr)
    assert "Traceback" not in out.stdout + out.stderr


def test_broken_third_party_entry_point_is_named_in_one_line(tmp_path):
    """A `kvhal` entry point whose module does not import: doctor names it, no traceback."""
    info = tmp_path / "kvhal_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvhal-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvhal]\nbroken = kvhal_broken_missing\n")
    out = subprocess.run([sys.executable, "-m", "kvhal.cli", "doctor"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode == 1
    assert out.stderr == ("kvhal doctor: error: entry point 'broken' = 'kvhal_broken_missing' "
                          "(distribution 'kvhal-broken', group 'kvhal') failed to load: "
                          "ModuleNotFoundError: No module named 'kvhal_broken_missing'\n")


@pytest.mark.parametrize("where", ["before", "after"],
                         ids=lambda w: f"third-party-{w}-built-in-on-sys-path")
@pytest.mark.parametrize("name, built_in", [
    ("cpu", "kvhal.backends.cpu.plugin"), ("tiers", "kvhal.tiers.plugin"),
    ("cache_policies", "kvhal.host.plugin")])
def test_third_party_entry_point_named_like_a_built_in_is_refused(tmp_path, where, name,
                                                                  built_in):
    """A real distribution (a dist-info on sys.path, ahead of or behind kvhal's own) whose
    `kvhal` entry point takes a built-in's name: refused naming both entry points, never
    skipped. Fails when a second entry point of a taken name is skipped silently."""
    info = tmp_path / "kvhal_shadow-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvhal-shadow\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvhal]\n{name} = kvhal_shadow\n")
    (tmp_path / "kvhal_shadow.py").write_text('"""A plugin with no hooks."""\n')
    script = (f"import sys; sys.path.{'insert(0, ' if where == 'before' else 'append('}"
              f"{str(tmp_path)!r})\nfrom kvhal import plugins\nplugins.backends()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)

    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    shadow = "'kvhal_shadow' (distribution 'kvhal-shadow')"
    own = f"{built_in!r} (distribution 'kvhal', built in)"
    pair = (shadow, own) if where == "before" else (own, shadow)
    assert last == (f"kvhal.plugins.PluginError: two 'kvhal' entry points are named {name!r}: "
                    f"{pair[0]} and {pair[1]}; a plugin name is registered once: rename the "
                    "third-party one")
