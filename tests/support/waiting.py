"""Polling for a condition with a deadline (the one copy every test folder uses)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll `pred` until it holds (True) or `timeout` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition",
             interval: float = 0.02) -> None:
    """Poll `pred` until it holds; AssertionError naming `what` after `timeout` seconds."""
    if not wait_until(pred, timeout, interval):
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
