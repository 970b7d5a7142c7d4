"""The HF Trainer adapter: the stream is the dataloader; packed batches get HF varlen names."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from service_helpers import job_dict, service_config, serving

from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream
from trainer_client.hf_trainer import StreamDataLoader


def test_loader_emits_model_inputs_and_counts_samples():
    samples = synthetic_samples(50, max_len=300)
    cfg = service_config(job_dict(world_size=1, batching={"collate": "packed"}))
    with serving(cfg, {"j": samples}) as svc, BatchStream(svc.address, "j", 0, 1) as s:
        loader = StreamDataLoader(s)
        got = list(loader)
        assert loader.samples_emitted == 50 == sum(int(len(b["cu_seq_lens_q"]) - 1) for b in got)
        assert loader.tokens_emitted == sum(x.num_tokens for x in samples)
        b = got[0]
        assert set(b) >= {"input_ids", "labels", "position_ids", "cu_seq_lens_q",
                          "cu_seq_lens_k", "max_length_q", "max_length_k"}
        assert isinstance(b["max_length_q"], int) and b["cu_seq_lens_q"].dtype == torch.int32
        assert list(loader) == []  # the job is done: the next pass is empty


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="the HF Trainer needs accelerate")
def test_streaming_trainer_trains_on_the_stream(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from trainer_client.hf_trainer import StreamingTrainer

    samples = synthetic_samples(40, max_len=64, vocab=100)
    cfg = service_config(job_dict(world_size=1, batching={"token_budget": 256}))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=16, n_layer=1,
                                       n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, report_to=[],
                             logging_steps=1, use_cpu=True, save_strategy="no")
    with serving(cfg, {"j": samples}) as svc, BatchStream(svc.address, "j", 0, 1) as s:
        trainer = StreamingTrainer(model=model, args=args, stream=s)
        trainer.train()
        assert trainer.state.global_step == 5
        assert trainer.loader.batches_emitted >= 5
