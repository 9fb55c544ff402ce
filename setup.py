"""Build script for the optional compiled guard; everything else is in pyproject.toml.

``treemode/_accel/_guard*.c`` speed up the revalidation of cached flattenings on every
transform call. It is optional: where it cannot be compiled (no C compiler),
the build goes on without it and treemode runs the same checks in Python.
"""

from setuptools import Extension, setup

_SOURCES = (
    "_guard",
    "_guard_kernels",
    "_guard_record",
    "_guard_executor",
    "_guard_write",
    "_guard_hold",
)
_HEADERS = ("_guard", "_border")

setup(
    ext_modules=[
        Extension(
            "treemode._accel._guard",
            # One module from six files (their jobs: treemode/_accel/_guard.h).
            [f"treemode/_accel/{name}.c" for name in _SOURCES],
            depends=[f"treemode/_accel/{name}.h" for name in _HEADERS],
            optional=True,
        )
    ]
)
