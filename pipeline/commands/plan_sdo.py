"""`odb-pipeline plan --data F --organization sdo`: the plan SDO makes, beside `none` on the
same data.

Per epoch the real preprocessing runs once; its samples feed two planners: the ordinary one in
file order (or --shuffle), which is `none`, and the SDO one fed the epoch's visits in traversal
order with the window `locality` asks for. The summary and JSON are the SDO plan's, plus
`organization` (settings, graph, embeddings, the `none` plan's padding efficiency and steps),
`locality` (mean pairwise cosine inside a batch: sdo, none, random pairs) and `exposure`
(min / max / p50 visits per sample and the longest unseen run, over the planned epochs).
`--emit-plan` writes each epoch's visits as one line `{"epoch", "mandatory", "visits"}` before
that epoch's steps, whose batches list visit ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter

from pipeline.commands.cli_job import progress
from pipeline.commands.plan_output import PlanOutput
from pipeline.errors import UserError

_SHOWN = 10


def _batches(events, out: list[list]) -> None:
    from pipeline.planner.types import Step

    for ev in events:
        if isinstance(ev, Step):
            out.extend(list(b.sample_ids) for b in ev.batches)


def run_sdo(args: argparse.Namespace, job, policy, source) -> int:
    from pipeline.organization.embed_stage import embed_dataset
    from pipeline.organization.epoch_visits import split_visit_id
    from pipeline.organization.exposure_ledger import ExposureLedger
    from pipeline.organization.ledger_store import MemoryLedgerStore, epoch_visits_for
    from pipeline.organization.locality import (
        batch_locality,
        batches_with_repeats,
        pair_baseline,
    )
    from pipeline.organization.organizer import organize
    from pipeline.planner.epochs import epoch_order, plan_epoch
    from pipeline.planner.plan_report import PlanReport
    from pipeline.planner.step_planner import StepPlanner

    org = job.organization
    none_planner = StepPlanner(policy, args.world_size, args.mode, args.seed, args.pool_steps)
    none_report = PlanReport(policy, args.world_size)
    store = MemoryLedgerStore()
    sdo_batches: list[list] = []
    none_batches: list[list] = []
    planner = organization = emb = None
    lost = 0
    t0 = time.perf_counter()
    with PlanOutput(PlanReport(policy, args.world_size), args.emit_plan) as out, source:
        progress("plan", "embedding the records (cached after the first run)")
        t_emb = time.perf_counter()
        emb = embed_dataset(job, limit=args.limit)
        t_emb = time.perf_counter() - t_emb
        for epoch in range(args.epochs):
            source.announce(epoch, args.epochs)
            measured = list(source.epoch(epoch))
            last = epoch == args.epochs - 1
            events = plan_epoch(none_planner, epoch_order(measured, epoch, seed=args.seed,
                                                          shuffle=args.shuffle_flag is True),
                                last=last)
            none_report.samples_in += len(measured)
            for ev in events:
                none_report.observe(ev)
            _batches(events, none_batches)
            if planner is None:
                try:
                    organization = organize(job, emb.table, measured, emb.path)
                except ValueError as exc:
                    raise UserError(f"--organization sdo: {exc}") from None
                planner = StepPlanner(
                    dataclasses.replace(policy, lookahead_tokens=organization.lookahead_tokens),
                    args.world_size, args.mode, args.seed, args.pool_steps)
            try:
                visits = epoch_visits_for(
                    store, job.job_id, organization.graph, epoch, seed=args.seed,
                    coverage_epochs=org.coverage_epochs,
                    visits_per_epoch=org.visits_per_epoch,
                    repeat_gap=organization.repeat_gap)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            samples = visits.planner_samples({m.sample_id: m for m in measured})
            lost += len(visits.visits) - len(samples)  # quarantined in this epoch only
            out.report.samples_in += len(samples)
            events = plan_epoch(planner, samples, last=last)
            out.write_line(json.dumps(visits.to_dict(), separators=(",", ":")))
            out.observe(events)
            _batches(events, sdo_batches)
    elapsed = time.perf_counter() - t0 - t_emb  # (the embedding is no part of planning)
    report = out.report

    table = emb.table
    graph = organization.graph
    ledger = ExposureLedger.from_dict(store.latest(job.job_id))
    by_str = {str(sid): sid for sid in graph.ids}
    sdo_samples = [[by_str[split_visit_id(v)[0]] for v in b] for b in sdo_batches]
    sdo_loc = batch_locality(sdo_samples, table.vector)
    none_loc = batch_locality([[s for s in b if s in table.row] for b in none_batches],
                              table.vector)
    members = table.vectors[[table.row[s] for s in graph.ids]]
    q = table.quarantined
    extra = {
        "organization": {
            "kind": "sdo", "knn_k": org.knn_k, "locality": org.locality,
            "coverage_epochs": org.coverage_epochs,
            "visits_per_epoch": org.visits_per_epoch or graph.size,
            "planner_lookahead_tokens": organization.lookahead_tokens,
            "repeat_gap": organization.repeat_gap,
            "visits_without_sample": lost,
            "graph": {"nodes": graph.size, "k": graph.k, "digest": graph.digest,
                      "max_in_degree": int(graph.in_degree.max()) if graph.size else 0},
            "embedding": {
                "made_by": table.made_by, "dim": table.dim, "cached": emb.cached,
                "seconds": round(t_emb, 4), "path": str(emb.path),
                "samples_without_vector": organization.without_vector,
                "quarantined": {"total": len(q),
                                "by_reason": dict(sorted(Counter(r.reason.value
                                                                 for r in q).items())),
                                "examples": [{"sample_id": r.sample_id, "reason": r.reason.value,
                                              "detail": r.detail} for r in q[:_SHOWN]]},
            },
            "none": {"padding_efficiency": round(none_report.padding_efficiency, 6),
                     "steps": none_report.steps},
        },
        "locality": {"sdo": _round(sdo_loc), "none": _round(none_loc),
                     "random_pairs": _round(pair_baseline(members)),
                     "sdo_batches_with_repeats": batches_with_repeats(sdo_samples)},
        "exposure": ledger.summary(),
    }
    ex = extra["exposure"]
    text = "\n".join([
        f"organization       sdo: {graph.size} samples in the graph (k={graph.k}), "
        f"{extra['organization']['visits_per_epoch']} visits/epoch, window "
        f"{organization.lookahead_tokens} tokens, embeddings "
        f"{'cached' if emb.cached else 'computed'}"
        f" ({table.made_by}, {table.dim}-d), {len(q)} record(s) without a vector",
        f"locality           sdo {_fmt(sdo_loc)}  none {_fmt(none_loc)}  random pairs "
        f"{_fmt(pair_baseline(members))}  (mean pairwise cosine within a batch)",
        f"padding vs none    sdo {report.padding_efficiency:.4f}  none "
        f"{none_report.padding_efficiency:.4f}",
        f"exposure           min {ex['min']}  p50 {ex['p50']}  max {ex['max']} visits over "
        f"{ex['epochs']} epoch(s); longest unseen run {ex['max_epochs_unseen']} epoch(s)",
    ])
    return out.print_result(args, source, policy, elapsed, extra, text)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
