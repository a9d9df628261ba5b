"""Map the repository's top-level folders onto the one import package `kvhal`.

`backends/`, `tiers/` and `integrations/` import as `kvhal.backends`, `kvhal.tiers` and
`kvhal.integrations`; every sub-package below them is found automatically.
"""
from setuptools import find_packages, setup

ROOTS = {"kvhal": "kvhal", "kvhal.backends": "backends", "kvhal.tiers": "tiers",
         "kvhal.integrations": "integrations"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
