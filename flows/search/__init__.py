"""The sweep flows' trials (sweep-charlm, sweep-images): a grid or a list queued on the free
workers, or (`--search`) an Optuna study asked and told from the flow process, trials run on
the cluster's free workers, pruned at their rungs, within a trials or trial-epochs budget.

flow: the steps both sweep flows share (workers, queued trials, the study's run); study: the
study, its sampler (TPE, random, grid) and pruner; storage: where the study lives (a journal
file in the artifact root); resume: taking over a study a killed flow left; referee: the
per-epoch verdicts the ranks wait for; board: what is running and done and the budget used,
for Prefect's progress artifact; plots: Optuna's plots for the parent MLflow run; run: the
search loop itself.
"""
