"""Refill jobs (inference consumers): requests admitted under a consumer's free token capacity.

Pure logic only, no I/O: the request and its cost rule (`request.py`), admission under a budget
(`admission.py`) and the lease table's state machine (`leases.py`). The Redis implementation
(`pipeline/coordinator/refill_state.py`) follows the same rules inside Lua; the tests check it
against these classes. See docs/refill.md.
"""
