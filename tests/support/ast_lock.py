"""`ast.parse` one thread at a time in the test process (a CPython 3.11 race).

CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread. When
a garbage collection inside one thread's `ast.parse` runs a finalizer and the GIL passes to
another thread that parses too, the first fails with "SystemError: AST constructor recursion
depth mismatch". In a test run both sides are common: pytest parses to show a traceback, and
3.11's `traceback` parses each frame's line (for its carets) whenever a thread logs an
exception, as stray service and client threads do at exit under load. A lock around
`ast.parse` closes it (an RLock: a finalizer may parse inside the same thread).
"""

from __future__ import annotations

import ast
import functools
import threading


def install() -> None:
    parse, lock = ast.parse, threading.RLock()

    @functools.wraps(parse)
    def one_at_a_time(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    ast.parse = one_at_a_time
