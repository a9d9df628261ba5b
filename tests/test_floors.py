"""Three floors (DESIGN §1): the core imports nothing above it, plug-ins reach each other only
through the core's contracts and the plugin registry, tools sit on top.

Every `.py` file of the four import roots is parsed (setup.py's folder → package mapping),
every import counted wherever it stands (module level or inside a function), relative ones
resolved; only imports under `if TYPE_CHECKING:` are left out (they never run).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: setup.py's mapping: import package → folder.
ROOTS = {"kvhal": "kvhal", "kvhal.backends": "backends", "kvhal.tiers": "tiers",
         "kvhal.integrations": "integrations"}
#: Plug-in families (floor 1): each may import the core and itself only.
PLUGINS = ("kvhal.backends", "kvhal.tiers", "kvhal.integrations.vllm", "kvhal.integrations.pd")
#: Tools (floor 2): may import anything.
TOOLS = ("kvhal.integrations.harness",)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def place(module: str) -> tuple[int, str]:
    """(floor, family) of a `kvhal` module: 0 core, 1 a plug-in family, 2 tools."""
    for tool in TOOLS:
        if _within(module, tool):
            return 2, tool
    for family in PLUGINS:
        if _within(module, family):
            return 1, family
    if _within(module, "kvhal.integrations") or _within(module, "kvhal.backends") \
            or _within(module, "kvhal.tiers"):
        return 1, module          # a package root (`kvhal.integrations`): its own family
    return 0, "kvhal"


def modules(repo: Path) -> dict[str, Path]:
    """Every module of the four roots by its import name."""
    out = {}
    for package, folder in ROOTS.items():
        base = repo / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "kvhal" and parts and parts[0] in ("backends", "tiers",
                                                             "integrations"):
                continue
            out[name] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every `kvhal` import in the module `name` at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # `from pkg import sub`: sub may be a module of its own
            out.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(line, m) for line, m in out if m == "kvhal" or m.startswith("kvhal.")]


def violations(repo: Path) -> list[str]:
    """Every import that goes up a floor or from one plug-in family into another."""
    known = modules(repo)
    found: list[str] = []
    for name, path in sorted(known.items()):
        floor, family = place(name)
        for line, target in imports(name, path):
            if target not in known and target.rpartition(".")[0] in known:
                target = target.rpartition(".")[0]     # `from module import attribute`
            if target not in known:
                continue
            t_floor, t_family = place(target)
            up = t_floor > floor
            across = floor == 1 and t_floor == 1 and t_family != family
            if up or across:
                where = path.relative_to(repo)
                message = (f"{where}:{line}: {name} imports {target} "
                           f"({'up a floor' if up else 'another plug-in'})")
                if message not in found:
                    found.append(message)
    return found


def test_no_import_goes_up_a_floor_or_across_plug_ins():
    assert violations(REPO) == []


@pytest.mark.parametrize("source,target,kind", [
    ("kvhal/engine/x.py", "from kvhal.tiers.fs import FsTier", "up a floor"),
    ("kvhal/engine/x.py", "def f():\n    from kvhal.integrations.harness import bench",
     "up a floor"),
    ("tiers/x.py", "from ..backends.cpu import CpuBackend", "another plug-in"),
    ("integrations/vllm/x.py", "from kvhal.tiers import fs", "another plug-in"),
    ("integrations/pd/x.py", "from kvhal.integrations.harness.vllm import model", "up a floor"),
])
def test_the_check_fails_on_an_upward_or_sideways_import(tmp_path, source, target, kind):
    """A copy of the repository's import roots with one bad import added fails the check."""
    for folder in ROOTS.values():
        for path in (REPO / folder).rglob("*.py"):
            dest = tmp_path / path.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text())
    bad = tmp_path / source
    bad.write_text(target + "\n")
    found = violations(tmp_path)
    assert len([f for f in found if f.startswith(source)]) >= 1
    assert all(kind in f for f in found if f.startswith(source))


def test_type_checking_imports_are_left_out(tmp_path):
    (tmp_path / "kvhal").mkdir()
    (tmp_path / "tiers").mkdir()
    (tmp_path / "tiers" / "__init__.py").write_text("")
    (tmp_path / "kvhal" / "__init__.py").write_text("")
    (tmp_path / "kvhal" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvhal.tiers import b\n")
    (tmp_path / "tiers" / "b.py").write_text("")
    assert violations(tmp_path) == []
    (tmp_path / "kvhal" / "a.py").write_text("from kvhal.tiers import b\n")
    assert "kvhal/a.py:1: kvhal.a imports kvhal.tiers.b (up a floor)" in violations(tmp_path)
