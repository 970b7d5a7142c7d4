"""The test process parses one thread at a time (support.ast_lock): threads that parse while
finalizers hand the GIL around never see CPython 3.11's "AST constructor recursion depth
mismatch" (without the lock this setup hits it within seconds on the CI machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

RACE = """
import ast, gc, sys, threading, time
from support import ast_lock
ast_lock.install()
gc.set_threshold(50, 5, 5)

class Cycle:
    def __init__(self): self.me = self
    def __del__(self): time.sleep(0)  # Python code in a finalizer: the GIL may pass

SRC = "x = [" + ",".join(f"f(a{i}, b[{i}] + c.d)" for i in range(300)) + "]"
errors = []

def parse_often():
    for _ in range(150):
        for _ in range(20):
            Cycle()
        try:
            ast.parse(SRC)
        except SystemError as exc:
            errors.append(str(exc))

threads = [threading.Thread(target=parse_often) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(errors[:1])
sys.exit(1 if errors else 0)
"""


def test_threads_parsing_at_once_never_mismatch():
    out = subprocess.run([sys.executable, "-c", RACE], cwd=TESTS, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
