"""The producer of a job: the one process that preprocesses and plans it, and where it runs.

`producer.py` (feed -> planner -> fenced publications), its feeds (`feed.py`, `ray_feed.py`,
`local_feed.py`, `sdo_feed.py`), where it runs (`hosting.py`: a thread, or the Ray actor of
`actor.py`), how it moves onto a new world (`adoption.py`), what its failures are
(`failures.py`); a refill job's producer (`refill_producer.py`). Nothing is imported here.
"""
