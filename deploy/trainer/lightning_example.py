"""PyTorch Lightning on an odb stream: `StreamDataModule` (join mode, checkpointed position).

    torchrun --nproc-per-node=2 deploy/trainer/lightning_example.py --max-steps 200 \
        --checkpoint-dir ckpt [--resume ckpt/last.ckpt]

Lightning has no Join: the data module's loader is aligned (a rank whose epoch ends first runs
filler steps of zero gradient). Its position rides in every Lightning checkpoint, so `--resume`
continues each rank exactly where it stopped.
"""

from __future__ import annotations

from example_setup import causal_lm, open_stream, parser, rank_and_world


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--max-epochs", type=int, default=1)
    p.add_argument("--checkpoint-dir", default="lightning-example-out")
    p.add_argument("--resume", default=None, help="a checkpoint file")
    args = p.parse_args()

    import torch

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    from trainer_client import causal_lm_loss
    from trainer_client.lightning_data import StreamDataModule

    class CausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = causal_lm(args.model_dir)

        def training_step(self, batch, batch_idx):
            labels = batch["labels"]
            logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            loss = causal_lm_loss(logits, labels, batch)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    rank, world = rank_and_world()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True,
                                        every_n_train_steps=50, save_top_k=-1)
    trainer = pl.Trainer(devices=world, strategy="ddp" if world > 1 else "auto",
                         max_steps=args.max_steps, max_epochs=args.max_epochs,
                         use_distributed_sampler=False, logger=False, callbacks=[ckpt],
                         enable_progress_bar=False)
    with open_stream(args, rank, world) as stream:
        trainer.fit(CausalLM(), datamodule=StreamDataModule(stream), ckpt_path=args.resume)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
