"""`BatchStream`: one rank's batches from the odb-pipeline service, as an iterator.

    stream = BatchStream("host:50051", "sft-1", rank, world_size, token=os.environ["ODB_TOKEN"])
    for epoch in range(epochs):
        for batch in stream:          # ends at this rank's END for the epoch
            inputs = batch.to_model_inputs("cuda", torch.bfloat16)
            loss = causal_lm_loss(model(**inputs).logits, inputs["labels"], batch)
    ckpt["data"] = stream.state_dict()   # restore: stream.load_state_dict(ckpt["data"])

Join mode (the default): ranks may get different numbers of steps in an epoch, so wrap the loop
in `torch.distributed.algorithms.Join` — a rank that reached its END shadows the collectives of
the ranks still training instead of leaving them blocked in an all-reduce:

    with Join([ddp_model]):
        for batch in stream: ...
Quota mode: every rank gets the same number of steps; no Join needed. Runtimes without Join
(HF Trainer, Lightning) use `trainer_client.loader.StreamLoader`, which gives a rank that ended
early filler steps until the epoch's last step.

Position: `next_step` (the global step after the last yielded batch) and `epoch` (the first
epoch whose END the trainer has not seen). A background thread keeps at most `prefetch`
undelivered batches (credits: the server sends only as many as the client has granted).
Batches are torch tensors when torch is installed, numpy arrays otherwise (`tensors=`).
Acks: taking batch k+1 (or the END) acknowledges batch k, at once, with the freed credit: the
service's acknowledged position is the trainer's exact one (but for the ack in flight), so a
rank that dies, a trainer restarted without its `state_dict`, a shrink or an elastic restart
hands back only the batch in progress. Connection failures reconnect with backoff and resume
from what was received; `reconnect_timeout` counts from the start of the outage.

Liveness (docs/trainer-client.md): gRPC keepalive pings the replica every `keepalive_time_s`
and drops a connection whose ping goes unanswered for `keepalive_timeout_s` (a frozen or cut
off replica: the stream fails over to another address of the target); a Heartbeat goes out on
the stream every `heartbeat_s` without another message, from gRPC's request-sending thread, so
a trainer busy in a long step, eval or checkpoint keeps its rank's lease, and a frozen trainer
process does not.

Memory: beside `prefetch` (batches), `prefetch_bytes` (default 256 MiB; 0: no limit) bounds the
tensor bytes of the batches received or on their way and not yet taken: the service sends a
batch only while it fits beside them, or when there are none (a batch larger than the window
comes alone). The stream thus holds at most max(prefetch_bytes, one batch) of batches besides
the one the trainer works on. A batch larger than the service's chunk size arrives in chunks,
each written into the batch's tensors (one allocation per tensor), and is yielded only once
whole: a connection cut mid-batch gets the batch again, whole, from the resumed stream.

Endpoint: any gRPC target (`host:port`, `dns:///svc:50051`, `ipv4:10.0.0.1:50051,10.0.0.2:50051`);
the channel fails over between the addresses it resolves with gRPC's own load-balancing policy
(`load_balancing`: `round_robin` over the replicas whose gRPC health is SERVING by default,
`trainer_client.channel`), and the reconnect loop resumes the stream there.
Exit: a stream left open (a trainer that stops early, raises or gets Ctrl-C) is closed at
interpreter exit, before gRPC's threads could abort the process.

Compute balancing (docs/compute-balancing.md): `stream.report_compute(batch, seconds)`, or
`with stream.timed(batch): ...` around forward + backward, tells the service how long the batch
took to compute; the reports ride on the next Ack (no round trip of their own), and a job with
`batching.compute_balancing` fits a cost model of them to balance ranks by time. Time compute
only: the wait inside collectives (the all-reduce of a faster rank) is what balancing removes;
`trainer_client.compute_clock.ComputeClock` times a DDP model's step without it (the framework
adapters report with it by themselves).

Model-parallel groups (docs/trainer-client.md): the tensor/context/pipeline-parallel members of
one data-parallel rank each open `BatchStream(endpoint, job, dp_rank, dp_size, group_size=k,
group_rank=j)` and all receive that rank's batches, byte-identical; the group holds the rank's
one lease and its acks count once (the rank moves with its slowest member, so a member that
restarts without a state gets the group's position); a lost member is a lost rank to the job's
`rank_failure_policy`. Any member's `state_dict()` restores any member. A group size another
live member disagrees with is refused (FAILED_PRECONDITION naming both): retried like a held
rank (a previous launch's member lapses) and raised after `reconnect_timeout`; a job that
cannot serve groups (no `batching.pad_to_multiple`) is raised at once.

Global steps (docs/global-steps.md): a job with a global token budget sends this rank several
batches per step, its micro-batches (`batch.info.micro_index` of `micro_count`), to accumulate
into one optimizer step: `trainer_client.accumulate.optimizer_steps` does it right (no_sync on
all but the last). A step counts as consumed once its last micro-batch was taken: `next_step`
stays at a step until then, its ack goes out when the next batch (or END) is taken, and a
resume restarts the step at its first micro-batch; a reconnection mid-step gets the rest of it
(the micro-batches already received are not yielded twice). `report_compute` of each
micro-batch is summed and sent once per step (what the service fits a rank's step on).

Elastic worlds (docs/elastic.md): when the job's world is reconfigured, this rank gets its
batches up to the boundary and then an END whose `reason` is "reconfigure" and whose
`world_size` is the new world's (`stream.last_end`; `stream.done` stays False). The rank then
opens `BatchStream(endpoint, job, new_rank, new_world_size)`, with or without this stream's
`state_dict()` (a state restores any rank of any world of the same job); iterating this stream
again raises `Reconfigured`.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import grpc

from trainer_client.batch_assembly import ChunkError, StreamReader
from trainer_client.channel import channel_options, open_channel, rotated
from trainer_client.decode import StreamBatch, TensorKind, resolve_tensor_kind
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc
from trainer_client.wire_format import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_KEEPALIVE_TIME_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_PREFETCH_BYTES,
    FINAL_STATUS_KEY,
    GROUP_REFUSED_PREFIX,
    MAX_GROUP_SIZE,
    MISMATCH_PREFIX,
    STREAM_ACCEPTED,
    WIRE_VERSION,
)

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,  # rank still held by our previous (dead) connection
}
RESUME_FROM_CURSOR = -1  # Open.resume_step: where the service's cursor says the rank left off
_STATE_VERSION = 2  # 2 adds epoch_first_step; version 1 states still load
_MAX_COMPUTE_PER_ACK = 64  # the service's bound per Ack; more wait for the next one
_MAX_COMPUTE_HELD = 1024  # reports not yet sent (a stream not acking): the oldest are dropped
log = logging.getLogger(__name__)


class StreamError(RuntimeError):
    """The service refused or ended the stream; `code` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Reconfigured(StreamError):
    """This stream's world ended at a reconfiguration: open a stream of the new world."""

    def __init__(self, job: str, rank: int, world_size: int) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION,
                         f"job {job!r}: the world of rank {rank} ended at a reconfiguration; "
                         f"open BatchStream(endpoint, {job!r}, rank, {world_size}) (with this "
                         "stream's state_dict) to continue")
        self.world_size = world_size


@dataclass(frozen=True)
class EpochEndInfo:
    epoch: int
    final_step: int  # this rank's last step of the epoch, -1 if none
    mode: str  # "join" | "quota"
    epoch_steps: int
    job_done: bool
    first_step: int = 0  # the epoch's first global step (steps are contiguous across epochs)
    reason: str = "epoch"  # "epoch" | "reconfigure" (this rank's world ended; the epoch goes on)
    world_size: int = 0  # reason "reconfigure": the new world's size

    @property
    def last_step(self) -> int:
        """The epoch's last global step on any rank."""
        return self.first_step + self.epoch_steps - 1


class _Link:
    """The channel, the live call and the receiver thread: what close() and interpreter exit
    must shut. Held apart from the stream so an exit finalizer reaches it without keeping the
    stream alive."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        self.reqs: queue.SimpleQueue | None = None
        self.call: Any = None
        self.thread: threading.Thread | None = None
        self.closing = False

    def stop(self, drain_s: float = 0.0) -> bool:
        """End the call (half-close, then cancel) and wait for the receiver to finish; False if
        it is still running after 5 s."""
        with self.lock:
            if self.reqs is not None:
                self.reqs.put(None)
            call = self.call
        self.closing = True  # the receiver returns when the call ends; no reconnect
        # A finalizer run by a garbage collection on the receiver thread itself cannot join it.
        thread = self.thread if self.thread is not threading.current_thread() else None
        if drain_s and thread is not None:
            # The server reads the acks still in flight, then ends the call itself.
            thread.join(drain_s)
        if call is not None:
            call.cancel()
        if thread is not None:
            thread.join(5.0)
        self.thread = None
        self.reqs = None
        return thread is None or not thread.is_alive()

    def shut(self, drain_s: float = 0.0, collect: bool = True) -> None:
        """Stop, then close the channel. `collect`: run a full garbage collection (always
        done when the receiver did not end)."""
        ended = self.stop(drain_s)
        with self.lock:
            self.call = None
        self.channel.close()
        if collect or not ended:
            # At interpreter exit this runs from atexit, while daemon threads still run: collect
            # any call left in a reference cycle now, not in the final GC (see _receive).
            gc.collect()


class BatchStream:
    def __init__(
        self, endpoint: str, job: str, rank: int, world_size: int, *,
        token: str | None = None, prefetch: int = 4, client_id: str | None = None,
        root_certificates: bytes | None = None, private_key: bytes | None = None,
        certificate_chain: bytes | None = None, max_message_mb: int = 256,
        reconnect_timeout: float = 60.0, backoff: tuple[float, float] = (0.05, 2.0),
        load_balancing: str = "round_robin", tensors: TensorKind = "auto",
        keepalive_time_s: float = DEFAULT_KEEPALIVE_TIME_S,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        group_size: int = 1, group_rank: int = 0, wait_log_s: float = 5.0,
    ) -> None:
        if not 1 <= group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}], got {group_size}")
        if not 0 <= group_rank < group_size:
            raise ValueError(f"group_rank must be in [0, group_size={group_size}), got "
                             f"{group_rank}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be >= 0 (0: no byte limit), got "
                             f"{prefetch_bytes}")
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.endpoint, self.job, self.rank, self.world_size = endpoint, job, rank, world_size
        self.group_size, self.group_rank = group_size, group_rank
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        member = f".{group_rank}" if group_size > 1 else ""
        self.client_id = client_id or f"{job}/{rank}{member}/{uuid.uuid4().hex[:12]}"
        self.reconnect_timeout = reconnect_timeout
        self.heartbeat_s = heartbeat_s
        self.tensors = resolve_tensor_kind(tensors)
        self._backoff = backoff
        self.wait_log_s = wait_log_s  # how often a stream that waits says what for (a warning)
        self._outage: str | None = None  # why the stream is reconnecting (None: it is not)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._target = endpoint  # (pick_first over a list of addresses: rotated at reconnects)
        self._load_balancing = load_balancing
        self._opts = channel_options(max_message_mb=max_message_mb,
                                     load_balancing=load_balancing,
                                     keepalive_time_s=keepalive_time_s,
                                     keepalive_timeout_s=keepalive_timeout_s,
                                     max_backoff_s=backoff[1])
        self._credentials = {"root_certificates": root_certificates, "private_key": private_key,
                             "certificate_chain": certificate_chain}
        channel = open_channel(endpoint, self._opts, **self._credentials)
        self._link = _Link(channel)
        # Runs at close() or, for a stream never closed, at interpreter exit.
        self._finalizer = weakref.finalize(self, _Link.shut, self._link)
        self._stub = pb_grpc.DataServiceStub(channel)
        self._stream = _raw_stream(channel)
        # Trainer-side position (what state_dict saves).
        self._next_step = 0
        self._epoch = 0
        self._epoch_first_step: int | None = 0
        self._done = False
        self._last_yielded = -1  # the last step whose batches were all yielded
        # (step, micro_index) of the last yielded micro-batch while its step has more: a new
        # receiver does not yield those again (None: at a step boundary).
        self._partial: tuple[int, int] | None = None
        self._step_compute: tuple[int, float] = (-1, 0.0)  # a step's micro-batches, summed
        # Until a state is loaded or a batch arrives, the service picks the position: the rank's
        # first unacknowledged step (a restarted trainer without a checkpoint goes on instead of
        # starting over, repeating at most the steps whose ack had not gone out).
        self._positioned = False
        self.last_end: EpochEndInfo | None = None
        self._reconfigured = 0  # the new world's size once this stream's world ended
        self.reconnects = 0
        # Receiver side.
        self._items: queue.Queue = queue.Queue()
        self._queued_batches = 0
        self._queued_bytes = 0  # their tensor bytes
        self._unsent_credits = 0  # freed queue slots not yet granted to the service
        self._unsent_credit_bytes = 0  # and their bytes
        self._unsent_compute: list[pb.ComputeReport] = []  # ride on the next Ack

    # --- checkpointing ---
    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "job": self.job, "rank": self.rank,
                "world_size": self.world_size, "next_step": self._next_step,
                "epoch": self._epoch, "done": self._done,
                "epoch_first_step": self.epoch_first_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; the stream (re)connects from it on the next iteration.

        The position (the global step after the consumed prefix, and the epoch) does not depend
        on the rank or the world size: a state of any rank of any world of the job restores this
        one (after a reconfiguration, the service maps a position at the end of the old world to
        the new world's first step). Only the job must match."""
        if state.get("job") != self.job:
            raise ValueError(f"state_dict is for job={state.get('job')!r}, "
                             f"this stream has job={self.job!r}")
        self._link.stop()
        self._unsent_compute.clear()  # of steps the restored position may not have reached
        self._partial, self._step_compute = None, (-1, 0.0)
        self._next_step = int(state["next_step"])
        self._epoch = int(state["epoch"])
        self._done = bool(state.get("done", False))
        self._last_yielded = self._next_step - 1
        self._positioned = True
        first = state.get("epoch_first_step")
        # A version-1 state has no epoch start: epoch 0 starts at 0, later ones are asked for.
        self._epoch_first_step = int(first) if first is not None else (
            0 if self._epoch == 0 else None)

    # --- iteration ---
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def done(self) -> bool:
        return self._done

    @property
    def next_step(self) -> int:
        """The global step after the last yielded batch (of a step with micro-batches left:
        that step, which a resume restarts at its first)."""
        return self._next_step

    @property
    def epoch_first_step(self) -> int:
        """The first global step of the current epoch (epochs' steps are contiguous)."""
        if self._epoch_first_step is None:
            ends = {e.epoch: e.steps for e in self.job_status().epoch_ends}
            missing = [e for e in range(self._epoch) if e not in ends]
            if missing:
                raise StreamError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"job {self.job!r} reports no step count for epochs {missing}")
            self._epoch_first_step = sum(ends[e] for e in range(self._epoch))
        return self._epoch_first_step

    def __iter__(self) -> Iterator[StreamBatch]:
        """Batches of the current epoch, up to this rank's END for it."""
        if self._done:
            return
        if self._reconfigured:
            raise Reconfigured(self.job, self.rank, self._reconfigured)
        self._ensure_receiver()
        yielded = False
        while True:
            item = self._take()
            if isinstance(item, EpochEndInfo) and item.reason == "reconfigure":
                # The epoch goes on in the new world: position and epoch stay as they are.
                self.last_end = replace(item, first_step=self._epoch_first_step or 0)
                self._reconfigured = item.world_size
                with self._link.lock:  # our last ack went out with this take: half-close
                    if self._link.reqs is not None:
                        self._link.reqs.put(None)
                return
            if isinstance(item, EpochEndInfo):
                if item.job_done and not yielded:
                    log.warning("job %s rank %d: the job has finished: every step was already "
                                "delivered and acknowledged, nothing is left to train (a new "
                                "job_id starts a new run; `odb-pipeline job reset %s` starts "
                                "this one over)", self.job, self.rank, self.job)
                first = self.epoch_first_step
                self.last_end = replace(item, first_step=first)
                self._epoch = item.epoch + 1
                self._epoch_first_step = first + item.epoch_steps
                self._done = item.job_done
                if item.job_done:  # the final ack went out with this take: half-close
                    with self._link.lock:
                        if self._link.reqs is not None:
                            self._link.reqs.put(None)
                return
            info = item.info
            if info.epoch > self._epoch:  # resumed at the cursor, in a later epoch
                self._epoch, self._epoch_first_step = info.epoch, None
            if info.last_micro:  # the step is consumed once its last micro-batch is taken
                self._last_yielded = info.step
                self._next_step = info.step + 1
                self._partial = None
            else:
                self._next_step = info.step
                self._partial = (info.step, info.micro_index)
            self._positioned = True
            yielded = True
            yield item

    def report_compute(self, batch: StreamBatch, seconds: float) -> None:
        """Report that `batch` took `seconds` of compute on this rank (forward + backward,
        without the wait inside collectives). Sent with the next Ack; a job that does not
        balance by compute ignores it. Micro-batches of one step are summed and sent with its
        last (a report of the last alone covers the step)."""
        info = batch.info
        seconds = float(seconds)
        with self._link.lock:
            if info.micro_count > 1:
                step, acc = self._step_compute
                seconds += acc if step == info.step else 0.0
                if not info.last_micro:
                    self._step_compute = (info.step, seconds)
                    return
                self._step_compute = (-1, 0.0)
            self._unsent_compute.append(pb.ComputeReport(step=info.step, seconds=seconds))
            del self._unsent_compute[:-_MAX_COMPUTE_HELD]

    @contextmanager
    def timed(self, batch: StreamBatch, sync: Callable[[], None] | None = None) -> Iterator[None]:
        """Time the block as `batch`'s compute and report it (`report_compute`) when it ends
        without an exception. `sync` (e.g. `torch.cuda.synchronize`) runs before each clock
        reading, so queued device work is counted where it ran."""
        if sync is not None:
            sync()
        start = time.perf_counter()
        yield
        if sync is not None:
            sync()
        self.report_compute(batch, time.perf_counter() - start)

    def ack(self) -> None:
        """Acknowledge the last yielded batch now (and grant the freed queue slots)."""
        with self._link.lock:
            self._send_ack_locked()

    def close(self) -> None:
        if self._finalizer.alive:
            if self._last_yielded >= 0:
                self.ack()  # what the trainer consumed is recorded before the call ends
            self._finalizer.detach()
            # Acks in flight are recorded first (drain). Once the receiver is joined, no thread
            # of this stream is left for the final GC to trip on: no full collection (75 ms of
            # CPU in a process with torch loaded, at every close, a reconfiguration's included).
            self._link.shut(drain_s=2.0, collect=False)

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def job_status(self, timeout: float = 10.0) -> pb.JobStatus:
        return self._stub.GetJob(pb.GetJobRequest(job_id=self.job), metadata=self._metadata,
                                 timeout=timeout)

    # --- internals ---
    def _take(self) -> StreamBatch | EpochEndInfo:
        since = time.monotonic()
        told = since
        while True:
            try:
                item = self._items.get(timeout=1.0)
                break
            except queue.Empty:
                thread = self._link.thread
                if thread is None or not thread.is_alive():
                    raise StreamError(grpc.StatusCode.UNAVAILABLE,
                                      "stream receiver stopped") from None
                now = time.monotonic()
                if now - told >= self.wait_log_s and self._outage is None:
                    told = now  # (while reconnecting, the receiver says why it waits)
                    log.warning("job %s rank %d: no batch from %s for %.0f s; the stream is "
                                "open and waits for the service to prepare the next one "
                                "(`odb-pipeline status` shows the job)", self.job, self.rank,
                                self.endpoint, now - since)
        if isinstance(item, StreamError):
            raise item
        with self._link.lock:
            # Taking the next item means the previous batch is done: ack it at once (the
            # service's position stays the trainer's) and free its slot.
            if isinstance(item, StreamBatch):
                self._queued_batches -= 1
                self._unsent_credits += 1
                self._queued_bytes -= item.nbytes
                self._unsent_credit_bytes += item.nbytes
            self._send_ack_locked()
        return item

    def _send_ack_locked(self) -> None:
        if self._link.reqs is not None:
            compute = self._unsent_compute[:_MAX_COMPUTE_PER_ACK]
            self._link.reqs.put(pb.ClientMessage(ack=pb.Ack(
                consumed_step=self._last_yielded, credits=self._unsent_credits,
                credit_bytes=self._unsent_credit_bytes, compute=compute)))
            self._unsent_credits = self._unsent_credit_bytes = 0
            del self._unsent_compute[:len(compute)]

    def _ensure_receiver(self) -> None:
        if not self._finalizer.alive:
            raise StreamError(grpc.StatusCode.CANCELLED, "the stream is closed")
        link = self._link
        if link.thread is None or not link.thread.is_alive():
            link.closing = False
            self._outage = None
            self._items = queue.Queue()
            self._queued_batches = self._queued_bytes = 0
            self._unsent_credits = self._unsent_credit_bytes = 0
            link.thread = threading.Thread(target=self._receive, name=f"odb-rank{self.rank}",
                                           daemon=True)
            link.thread.start()

    def _receive(self) -> None:
        link = self._link
        pos = self._next_step if self._positioned else RESUME_FROM_CURSOR
        # A step's micro-batches received (or yielded) so far: a resumed call restarts the step
        # at its first, and those are not queued again.
        received = self._partial
        epoch = self._epoch
        delay = self._backoff[0]
        outage_since: float | None = None  # the first failure of the current outage
        told = 0.0  # when the current outage was last logged
        job_done = False  # (or this world ended: the server closes, nothing to resume)
        while not link.closing:
            reqs: queue.SimpleQueue = queue.SimpleQueue()
            with link.lock:
                credits = max(1, self.prefetch - self._queued_batches)
                # This Open grants every free slot; the bytes of the batches still queued
                # count against the byte window until the trainer takes them.
                self._unsent_credits = self._unsent_credit_bytes = 0
                reqs.put(pb.ClientMessage(open=pb.Open(
                    job_id=self.job, rank=self.rank, world_size=self.world_size,
                    resume_step=pos, resume_epoch=epoch, client_id=self.client_id,
                    credits=credits, wire_version=WIRE_VERSION,
                    prefetch_bytes=self.prefetch_bytes, held_bytes=self._queued_bytes,
                    group_size=self.group_size, group_rank=self.group_rank)))
                link.reqs = reqs
                link.call = call = self._stream(_requests(reqs, self.heartbeat_s),
                                                metadata=self._metadata)
            reader = StreamReader(self.tensors)  # a batch cut off with its call is dropped
            try:
                if _accepted(call):  # the call works: the outage, if any, is over
                    outage_since = None
                    delay = self._backoff[0]
                for raw in call:
                    outage_since = self._outage = None
                    delay = self._backoff[0]
                    item = reader.read(raw)
                    if isinstance(item, StreamBatch):
                        info = item.info
                        if (received is not None and info.step == received[0]
                                and info.micro_index <= received[1]):
                            with link.lock:  # had it already: its credit goes straight back
                                self._unsent_credits += 1
                                self._unsent_credit_bytes += item.nbytes
                                self._send_ack_locked()
                            continue
                        if info.last_micro:
                            pos, received = info.step + 1, None
                        else:
                            pos = info.step
                            received = (info.step, info.micro_index)
                        with link.lock:
                            self._queued_batches += 1
                            self._queued_bytes += item.nbytes
                        self._items.put(item)
                    elif item is not None:
                        e = item
                        reconfigure = e.reason == pb.END_REASON_RECONFIGURE
                        if not reconfigure:
                            epoch = e.epoch + 1
                        self._items.put(EpochEndInfo(
                            e.epoch, e.final_step, pb.Mode.Name(e.mode).lower(), e.epoch_steps,
                            e.job_done, reason="reconfigure" if reconfigure else "epoch",
                            world_size=e.world_size))
                        job_done = job_done or e.job_done or reconfigure
                if job_done:  # the server closes after our final ack (see __iter__)
                    return
                code, details = grpc.StatusCode.UNAVAILABLE, "stream ended without END"
                final = False
            except ChunkError as exc:  # the service sent a batch that does not add up
                call.cancel()
                self._items.put(StreamError(grpc.StatusCode.INTERNAL, str(exc)))
                return
            except grpc.RpcError as exc:
                if job_done:
                    return
                # Keep the status, not the error: the error is the call itself, and holding it
                # in this frame makes a cycle that only the interpreter's final GC frees, whose
                # grpc __del__ can then deadlock on a lock of a frozen daemon thread.
                code, details = exc.code(), exc.details() or ""
                final = _final(exc)
            finally:
                reqs.put(None)  # ends the request iterator of this call
            del call
            if link.closing:
                return
            retry = (code in _RETRYABLE and not final
                     and not details.startswith((MISMATCH_PREFIX, GROUP_REFUSED_PREFIX)))
            # The outage runs from its first failed call: a call that failed (however long it
            # took: a replica cut from the state answers only after its state timeout) never
            # restarts it; only an accepted call or a message does.
            now = time.monotonic()
            if outage_since is None:
                outage_since = now
            if not retry or now - outage_since > self.reconnect_timeout:
                self._items.put(StreamError(code, details))
                return
            if self._outage is None or now - told >= self.wait_log_s:
                told = now
                log.warning("job %s rank %d: waiting for the service at %s for %.0f s (giving "
                            "up after reconnect_timeout %g s); it says %s: %s", self.job,
                            self.rank, self.endpoint, now - outage_since,
                            self.reconnect_timeout, code.name, details)
            self._outage = f"{code.name}: {details}"
            self.reconnects += 1
            if self._load_balancing == "pick_first":
                self._next_address_first()
            time.sleep(delay)
            delay = min(delay * 2, self._backoff[1])


    def _next_address_first(self) -> None:
        """Reconnect through the target's next address first (`channel.rotated`): a replica
        that ended the stream itself (it cannot reach the job's state) is still connected,
        and `pick_first` would choose it again."""
        target = rotated(self._target)
        if target is None:
            return
        self._target = target
        channel = open_channel(target, self._opts, **self._credentials)
        with self._link.lock:
            old, self._link.channel = self._link.channel, channel
            self._stub = pb_grpc.DataServiceStub(channel)
            self._stream = _raw_stream(channel)
        old.close()


def _accepted(call: Any) -> bool:
    """Whether the replica accepted the call's Open (its initial metadata, sent once the rank
    is claimed; waits for it, the first message or the call's end)."""
    try:
        return STREAM_ACCEPTED in tuple(call.initial_metadata() or ())
    except grpc.RpcError:
        return False


def _final(exc: grpc.RpcError) -> bool:
    """The service says not to retry (`FINAL_STATUS_KEY`): the job failed for good."""
    try:
        return any(k == FINAL_STATUS_KEY for k, _ in exc.trailing_metadata() or ())
    except Exception:  # an error raised before the call had trailers
        return False


def _raw_stream(channel: grpc.Channel) -> Any:
    """The Stream method with the server's messages left serialized: `StreamReader` takes a
    chunk's bytes out of them without parsing (a copy) first."""
    return channel.stream_stream("/odb.v1.DataService/Stream",
                                 request_serializer=pb.ClientMessage.SerializeToString,
                                 response_deserializer=None)


def _requests(reqs: queue.SimpleQueue, heartbeat_s: float) -> Iterator[pb.ClientMessage]:
    """A call's requests: what the stream queues (None ends them), and a Heartbeat whenever
    nothing went out for `heartbeat_s`. gRPC runs this on its request-sending thread, never
    the training loop's: a busy trainer still beats, a frozen process does not."""
    beat = pb.ClientMessage(heartbeat=pb.Heartbeat())
    while True:
        try:
            msg = reqs.get(timeout=heartbeat_s)
        except queue.Empty:
            yield beat
            continue
        if msg is None:
            return
        yield msg


def open_streams(endpoint: str, job: str, world_size: int, **kw: Any) -> list[BatchStream]:
    """One stream per rank (single-process tests and demos)."""
    return [BatchStream(endpoint, job, r, world_size, **kw) for r in range(world_size)]
