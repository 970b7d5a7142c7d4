"""A serving replica (the data plane): every job it serves, its rank streams and the gRPC server.

- `server.py` starts and stops one replica; `job_runtime.py` wires one job's parts on it;
- `data_server.py` is the thin gRPC adapter (one table from domain errors to status codes),
  `rank_stream.py` one rank's stream without gRPC, driving `rank_cursor.py` (pure);
  `liveness.py` the rank failure policies; `world_open.py` and `scaling.py` reconfigurations;
- `plan_view.py`, `stream_io.py`, `coalescer.py`: the plan and the job's state as the streams
  read and write them; `credit_window.py` a stream's step and byte credits; `payloads.py`,
  `collate.py`, `batch_builder.py`, `chunk_framing.py`, `wire_codec.py`: a rank's batch from
  payloads to wire bytes (chunked when large); `batch_bound.py` the largest batch a job sends;
- `refill_server.py` the Refill RPC of `mode: refill` jobs; `auth.py` and `exposure.py` who may
  call; `loop_server.py` the `grpc.aio` server; `state_factory.py` where a job's state lives.
Replicas hold caches only: everything job-wide is in the `JobState` (`pipeline.jobstate`).
"""
