"""What runs inside the trainer: the per-rank batch stream and its helpers.

Needs only grpcio, protobuf and numpy (`pip install ./trainer_client` installs the light
`odb-trainer-client` distribution); batches are torch tensors when torch is installed. The
framework adapters (`hf_trainer`, `accelerate_join`, `lightning_data`) import their framework
when used, never here.
"""

from trainer_client.accumulate import MicroBatches, StepOutOfOrder, optimizer_steps
from trainer_client.batch_stream import BatchStream, EpochEndInfo, Reconfigured, StreamError
from trainer_client.decode import BatchInfo, ModelInputs, StreamBatch
from trainer_client.loader import StreamLoader
from trainer_client.loss import causal_lm_loss, loss_scale
from trainer_client.pixels import PixelNorm
from trainer_client.refill_stream import RefillStream, Request
from trainer_client.wire_format import WIRE_VERSION

__all__ = ["WIRE_VERSION", "BatchInfo", "BatchStream", "EpochEndInfo", "MicroBatches",
           "ModelInputs", "PixelNorm", "Reconfigured", "RefillStream", "Request", "StepOutOfOrder",
           "StreamBatch", "StreamError", "StreamLoader", "causal_lm_loss", "loss_scale",
           "optimizer_steps"]
