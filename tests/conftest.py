"""Puts the repository root on ``sys.path``, so that ``tests.registry`` and ``tests.helpers``
import the same way however pytest was started (``pytest``, ``python -m pytest``, one file)."""

import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:
    sys.path.insert(0, REPO)
