"""The node agent's tests import ``localcluster`` from ``hack/``."""

import sys
from pathlib import Path

HACK = str(Path(__file__).resolve().parents[3])
if HACK not in sys.path:
    sys.path.insert(0, HACK)
