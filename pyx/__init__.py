"""Cython hot loops of paged-run: block pool, KV cache manager, scheduler.

These modules are compiled by CMake at install time (`pip install .`). Importing them from a
source checkout that was never built raises an ImportError that says how to build.
"""
