"""Build script for the optional compiled guard; everything else is in pyproject.toml.

``treemode/_accel/_guard.c`` speeds up the revalidation of cached flattenings on every
transform call. It is optional: where it cannot be compiled (no C compiler),
the build goes on without it and treemode runs the same checks in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("treemode._accel._guard", ["treemode/_accel/_guard.c"], optional=True)]
)
