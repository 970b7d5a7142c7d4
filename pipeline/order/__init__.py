"""The order of an epoch (the planner's input): pure, apart from reading row counts.

Import from the modules (this package imports nothing):

- `read_units`   a source's rows cut into read units (JSONL runs of lines, Parquet row groups)
- `mixture`      `Mixture`: named sources with repeat / choose / weight; counts per epoch
- `interleave`   Webster's rule: how positions are shared among sources, in every prefix
- `permute`      seeded permutations fixed across machines and library versions
- `epoch_order`  `EpochOrder`: position -> (source, file, row, copy); blocks to read
- `cursor`       `OrderCursor`: where the feed stands, and the mixture changes in force
- `job_order`    a job's sources and settings -> each epoch's `EpochOrder`
"""
