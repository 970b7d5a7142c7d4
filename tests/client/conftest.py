"""tests/client reuses the data-plane helpers (a served job, consume_all) of tests/service."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
