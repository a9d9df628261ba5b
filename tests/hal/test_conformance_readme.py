"""conformance/README.md, the backend author's guide, stays complete."""
from __future__ import annotations

import re
from pathlib import Path

from kvhal.hal import DeviceBackend

REPO = Path(__file__).resolve().parents[2]
GUIDE = (REPO / "conformance" / "README.md").read_text()


def test_guide_lists_every_hal_method():
    """Fails when a `DeviceBackend` method is added without its line in the guide."""
    methods = {n for n, v in vars(DeviceBackend).items()
               if not n.startswith("_") and callable(getattr(DeviceBackend, n))}
    assert "copy_2d_batch_async" in methods and "probe" in methods
    assert sorted(m for m in methods if not re.search(rf"`{m}\(", GUIDE)) == []


def test_guide_describes_every_conformance_module():
    modules = sorted(p.name for p in (REPO / "conformance").glob("test_*.py"))
    assert [m for m in modules if f"| `{m}` |" not in GUIDE] == []


def test_guide_names_the_commands_and_chaos_seed_and_the_readme_points_to_it():
    for needed in ("pip install -e '.[dev]'", "pytest conformance/ --kvhal-backend=NAME",
                   "pytest conformance/ --kvhal-tier=NAME", "chaos_seed",
                   "kvhal_register_backends", "[project.entry-points.kvhal]",
                   "InvalidValueError"):
        assert needed in GUIDE, needed
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Writing a backend"):]
    assert "conformance/README.md" in section[:section.index("\n## ", 3)]
