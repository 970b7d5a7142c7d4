"""What the example trainers share: where the stream is, which rank this is, and a model.

Environment: PIPELINE_ENDPOINT (any gRPC target: host:port, dns:///svc:50051, ...), PIPELINE_JOB,
PIPELINE_TOKEN (the job's bearer token), PIPELINE_TLS_CA (a CA certificate file: the service
speaks TLS and is trusted through it); RANK / WORLD_SIZE / LOCAL_RANK from torchrun (a
single process without torchrun is rank 0 of 1). Two models: the framework examples (HF Trainer,
Accelerate, Lightning, the loader) train a small Qwen2 built from a config (nothing downloaded)
unless --model-dir names a local checkpoint (`parser`, `causal_lm`); the plain DDP examples
(train_example.py, elastic_example.py) a toy over token ids (`toy_parser`, `ToyLM`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

QWEN_VOCAB = 151936  # the service's real Qwen tokenizer ids fit


def _stream_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--endpoint", default=os.environ.get("PIPELINE_ENDPOINT", "localhost:50051"))
    p.add_argument("--job", default=os.environ.get("PIPELINE_JOB", "example-job"))
    return p


def parser(description: str) -> argparse.ArgumentParser:
    """The framework examples' arguments (a Qwen2 model): --endpoint, --job, --max-steps, --lr,
    --model-dir."""
    p = _stream_parser(description)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--model-dir", default=None, help="a local HF causal LM; default: tiny Qwen2")
    return p


def toy_parser(description: str, *, vocab: int, dim: int) -> argparse.ArgumentParser:
    """The plain DDP examples' arguments (a `ToyLM`): --endpoint, --job, --vocab, --dim, --lr."""
    p = _stream_parser(description)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--lr", type=float, default=1e-3)
    return p


class ToyLM(torch.nn.Module):
    """Token embedding + linear head over token ids folded into `vocab` ids: what the examples
    show is the data-plane wiring, not the model."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids % self.vocab)))


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def open_stream(args: argparse.Namespace, rank: int, world: int, **options: Any) -> Any:
    """This rank's `BatchStream` (`options`: more of its keyword arguments)."""
    from trainer_client import BatchStream

    return BatchStream(args.endpoint, args.job, rank, world, **stream_credentials(), **options)


def stream_credentials() -> dict[str, Any]:
    """The job's token and, with PIPELINE_TLS_CA, the CA that the service's TLS certificate is
    checked against (BatchStream keyword arguments)."""
    ca = os.environ.get("PIPELINE_TLS_CA")
    return {"token": os.environ.get("PIPELINE_TOKEN") or None,
            "root_certificates": Path(ca).read_bytes() if ca else None}


def causal_lm(model_dir: str | None) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if model_dir:
        return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    torch.manual_seed(0)  # every rank starts from the same weights
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def exit_skipping_finalization(code: int) -> NoReturn:
    """End a torch.distributed trainer that finished cleanly: flush, then leave without
    interpreter finalization.

    DDP keeps the gloo process group, and so its worker threads, alive past
    destroy_process_group. A worker still releasing the last collective's tensor when the
    interpreter finalizes must take the GIL; a finalizing interpreter ends such a thread inside a
    C++ destructor and the process aborts (SIGABRT, "terminate called without an active
    exception") after a clean run: 3 of 80 two-rank runs of train_example.py on a 2-core machine.
    Call this once the streams, files and the process group are closed, and while the DDP model
    is still referenced (in the function that made it): freeing it destroys the process group,
    whose destructor joins those threads holding the GIL, and a worker releasing a tensor then
    waits for the GIL forever (seen after elastic_example.py's checkpoint broadcasts: the
    process hung at exit in 3 of about 40 runs).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
