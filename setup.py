"""Builds the optional native kernels; everything else is configured in pyproject.toml.

The extension is optional: where it cannot be compiled the package installs without it and
uses its pure-Python paths (see hicache_async/_native/__init__.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hicache_async._native._kernels",
            ["hicache_async/_native/_kernels.c"],
            extra_compile_args=["-O3", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
