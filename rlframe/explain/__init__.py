"""`rlframe explain`: the batch plan of a config, its keys in effect, and a packing simulation.

Under `trainer.v1.trainer_mode=separate_async` or `colocate_async` it also shows where generation runs, the
staleness bound, when generation is cut and what the batches in flight hold (`rlframe.trainer.async_plan`); its
warnings are `rlframe train`'s launch warnings.

No Ray and no model weights: it runs `rlframe train`'s launch checks (config, model folder, device,
datasets; `--plan-only` skips those that need files), then prints the plan. Four modules, one idea each:

- `report`: `explain()`, the whole report: the launch checks give the plan, key statuses and warnings, then
  the sections in order (text or JSON);
- `simulation`: the lengths of one step (made up or recorded) and the balancing and micro-batching they go
  through, on the real code path (`rlframe.seqpack`);
- `formatting`: each section's text;
- `cli`: the `rlframe explain` command's arguments and exit status.
"""
