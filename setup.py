"""Map the repository's top-level folders onto the one import package `kvhal`.

`backends/`, `tiers/` and `integrations/` import as `kvhal.backends`, `kvhal.tiers` and
`kvhal.integrations`; every sub-package below them is found automatically.

`kvhal.tiers.fs._chunkio` (`tiers/fs/_chunkio.c`) is the fs tier's GIL-free chunk I/O. It is
optional: without a C compiler the install still succeeds and the tier makes the same system
calls from Python (`kvhal.tiers.fs.fileio.FAST_IO` says which).
"""
from setuptools import Extension, find_packages, setup

ROOTS = {"kvhal": "kvhal", "kvhal.backends": "backends", "kvhal.tiers": "tiers",
         "kvhal.integrations": "integrations"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

CHUNKIO = Extension("kvhal.tiers.fs._chunkio", ["tiers/fs/_chunkio.c"], optional=True,
                    extra_compile_args=["-O2", "-Wall"])

setup(packages=packages, package_dir=package_dir, ext_modules=[CHUNKIO])
