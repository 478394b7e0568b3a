"""Packaging: the repository's top-level folders install under one namespace, `kiln`.

pyproject.toml holds the metadata; this file only lists the packages, because setuptools'
declarative `find` cannot prefix them. A user's own `models.py`, or another package's
`runtime`, never collides with Kiln's `kiln.models` and `kiln.runtime`.
"""
from setuptools import find_packages, setup

FOLDERS = ("models", "builder", "plugins", "runtime", "engines", "bench")

packages, package_dir = ["kiln"], {"kiln": "kiln"}
for folder in FOLDERS:
    package_dir[f"kiln.{folder}"] = folder
    packages += [f"kiln.{folder}"] + [f"kiln.{folder}.{sub}" for sub in find_packages(folder)]

# CUDA C++ sources that build-engine compiles with nvcc (`plugins.nvcc`) ship beside their modules.
setup(packages=packages, package_dir=package_dir, package_data={"kiln.plugins.linear": ["*.cu"]})
