"""What runs inside the trainer: the per-rank batch stream and its helpers.

No Ray, no preprocessing imports: only torch, grpc and the generated odb.v1 stubs.
"""

from trainer_client.batch_stream import BatchStream, EpochEndInfo, StreamError
from trainer_client.decode import BatchInfo, StreamBatch
from trainer_client.loss import loss_scale

__all__ = ["BatchInfo", "BatchStream", "EpochEndInfo", "StreamBatch", "StreamError",
           "loss_scale"]
