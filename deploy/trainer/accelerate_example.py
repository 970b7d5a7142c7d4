"""Accelerate on an odb stream in join mode: `joined_epoch` around each epoch.

    accelerate launch --num-processes 2 deploy/trainer/accelerate_example.py --max-steps 200

A rank whose epoch ends first joins (torch Join through `accelerator.join_uneven_inputs`) and
shadows the others' gradient all-reduces; `causal_lm_loss` scales each rank's loss from the
step's all-rank token count, so the averaged gradient is that of the step's mean loss.
The stream is never `accelerator.prepare`d: the service already shards it per rank.
"""

from __future__ import annotations

from example_setup import causal_lm, open_stream, parser


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()

    import torch
    from accelerate import Accelerator

    from trainer_client import causal_lm_loss
    from trainer_client.accelerate_join import joined_epoch

    acc = Accelerator()
    model = causal_lm(args.model_dir)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
    steps = 0
    with open_stream(args, acc.process_index, acc.num_processes) as stream:
        while True:
            with joined_epoch(acc, stream, [model]) as batches:
                for inputs in batches:
                    labels = inputs.pop("labels")
                    loss = causal_lm_loss(model(**inputs).logits, labels, inputs)
                    acc.backward(loss)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    steps += 1
                    if steps % 10 == 0:
                        acc.print(f"step {inputs.info.step} loss {loss.item():.4f}")
                    if inputs.info.step + 1 >= args.max_steps:  # a global step: same cut
                        break
            # Out of the join every rank is in step again: agree on stopping, so no rank starts
            # another epoch's collectives alone (a joined rank never saw the cut).
            stop = torch.tensor([int(stream.done or stream.next_step >= args.max_steps)],
                                device=acc.device)
            if acc.reduce(stop, reduction="max").item():
                break
    acc.print(f"rank {acc.process_index}: {steps} steps")
    acc.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
