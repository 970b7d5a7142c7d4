"""Structure-aware data organization (SDO): which samples train together, and how often.

On top of ODB's token budgets: frozen embeddings -> a KNN graph -> per epoch, a budget of sample
visits drawn by a neighborhood traversal under an exposure ledger with a coverage floor -> the
ordinary `StepPlanner` forms budgeted, DGAP-aligned steps from that order (docs/sdo.md).

Pure logic apart from I/O, like the planner. This package imports nothing; import the modules:

- `knn_graph`         KnnGraph, build_knn_graph (faiss): each sample's k nearest neighbours
- `exposure_ledger`   ExposureLedger: per-sample visit counts and last-seen epochs (JSON state)
- `traversal`         neighborhood_walk: the locality-ordered sequence of one epoch's visits
- `epoch_visits`      Visit, EpochVisits, plan_epoch_visits: (graph, ledger, epoch) -> visits
- `ledger_store`      LedgerStore (the interface the coordinator implements), MemoryLedgerStore
- `locality`          the `locality` knob (planner window) and its measure (within-batch cosine)
- `embedding_table`   EmbeddingTable and the checks a vector must pass
- `embedding_text`    what text of a record is embedded
- `encoder`           packaged / local sentence-embedding models, loaded offline
- `embedding_cache`   the cache beside the dataset, keyed by model and content hash
- `embed_stage`       the Ray Data stage that computes (or reads) the embeddings once
- `organizer`         wiring for one job: embeddings + measured samples -> graph -> epoch samples
"""
