"""Fixtures for the prefill/decode and swap tests: the serving, cache-manager and router
harnesses live with their own tests; their directories are put on ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
for _dir in ("serving", "cache_manager", "router"):
    sys.path.insert(0, str(_TESTS / _dir))
