"""The LoRA tests import their helpers by name: lora_helpers.py here, the engine tests'
engine_helpers.py (tiny random models, the request driver) and the tensor-parallel tests'
tp_helpers.py (models written as directories), so those folders go on sys.path."""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(__file__)
for _path in (_HERE, *(os.path.join(os.path.dirname(_HERE), d)
                       for d in ("engine", "distributed"))):
    if _path not in sys.path:
        sys.path.insert(0, _path)
