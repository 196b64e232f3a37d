"""A shim for tools that still call ``setup.py``; every piece of metadata is in pyproject.toml."""

from setuptools import setup

setup()
