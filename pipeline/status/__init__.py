"""The operator's status client (`odb-pipeline status`): where to ask (`sources.py`: flags, or
the local service found as `serve` configured itself), asking (`query.py`: GetJob, the metrics
port's `/status.json`, Redis, each answer read into a `JobStatus`), merging the answers of one
job (`merge.py`), and the report it prints (`report.py`: JSON; `text.py`: text).

The status value and its renderings for the service's own outputs (GetJob, `/status.json`, the
page, Prometheus) are the exporters' (`pipeline.observability`); this package only reads them.
"""
