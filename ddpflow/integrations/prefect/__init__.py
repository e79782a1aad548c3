"""Prefect around ddpflow.run: `ddpflow.run_in_flow` (the `ddp-train` task), the flow's Dask
client, and the progress artifact that follows a training. The only part of the library that
imports prefect, loaded when a user (or the built-in tasks) asks for it."""
