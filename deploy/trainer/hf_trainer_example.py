"""The Hugging Face Trainer on an odb stream (join mode, exact loss scaling, resumable).

    torchrun --nproc-per-node=2 deploy/trainer/hf_trainer_example.py --max-steps 200 \
        --output-dir ckpt [--resume]

Each rank streams its own batches (`StreamingTrainer`, trainer_client/hf_trainer.py): a rank
whose epoch ends first runs filler steps, so the Trainer's collectives stay in step; checkpoints
carry every rank's stream position and `--resume` continues exactly where they stopped.
"""

from __future__ import annotations

from example_setup import causal_lm, open_stream, parser, rank_and_world


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="hf-example-out")
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="from the last checkpoint")
    args = p.parse_args()

    import torch
    from transformers import TrainingArguments

    from trainer_client.hf_trainer import StreamingTrainer

    rank, world = rank_and_world()
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=args.lr,
        save_steps=args.save_steps, logging_steps=10, report_to=[],
        use_cpu=not torch.cuda.is_available(), ddp_backend=None if torch.cuda.is_available()
        else "gloo", bf16=torch.cuda.is_available())
    with open_stream(args, rank, world) as stream:
        trainer = StreamingTrainer(model=causal_lm(args.model_dir), args=targs, stream=stream)
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
