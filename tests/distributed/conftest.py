"""The tensor-parallel tests' folder is put on sys.path so they import tp_helpers by name."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
