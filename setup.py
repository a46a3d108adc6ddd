"""The one packaging decision pyproject.toml cannot state: where the folders install.

The repository keeps its top-level folders (``decoders``, ``proposers``, ``verifiers``,
``train``, ``conf``), but they install as subpackages of one namespace, ``specdec``, so
``pip install`` puts nothing named ``train`` or ``proposers`` at the top of site-packages:
``decoders/engine/pipeline.py`` is ``specdec.decoders.engine.pipeline``. Every subpackage
under the folders is found here, so a new one needs no line in this file.
"""

from setuptools import find_packages, setup

FOLDERS = ("decoders", "proposers", "verifiers", "train")

setup(
    packages=[f"specdec.{name}" for name in find_packages(include=[f"{f}*" for f in FOLDERS])]
    + ["specdec.conf"],
    package_dir={f"specdec.{folder}": folder for folder in (*FOLDERS, "conf")},
    package_data={
        "specdec.conf": ["*.yaml", "**/*.yaml"],
        "specdec.decoders": ["evaluation/data/*.jsonl"],
        "specdec.proposers": [
            "shipped/**/*"
        ],  # the default target's trained drafters (README "Shipped drafters")
    },
)
