"""Pure planning logic: cost model, online batch forming, DGAP step planning.

No I/O, no Ray, gRPC or Redis. Import from the modules (this package imports nothing, so
`pipeline.planner.types` stays cheap for everyone who only needs the vocabulary):

- `types`         MeasuredSample, Batch, StepInfo, Step, Quarantined, EpochEnd, WorldStamp,
                  Collate (the job's mode and over-budget policy: `pipeline.modes`)
- `policy`        BatchingPolicy: every knob, validated
- `cost_model`    CostModel: token cost (what the budget caps) and compute cost (what is balanced)
- `batch_former`  BatchFormer: bounded online window -> batches under the caps
- `rank_balancer` group_by_cost / rank_order: batches -> balanced steps
- `step_planner`  StepPlanner (feed / end_epoch / snapshot / restore / reconfigure),
                  PlannerState, pool_size (the rank-balancing pool)
- `epochs`        a job's epochs through one planner: epoch_order, plan_epoch, plan_epochs
- `oracle`        gmt_batches: the offline bound a plan is measured against
- `plan_report`   PlanReport: statistics of a plan (CLI `plan`, benchmark)
- `lengths_file`  read_lengths / parse_lengths for the `plan` CLI
"""
