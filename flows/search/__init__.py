"""The sweep flow's search mode (`--search`): an Optuna study asked and told from the flow
process, trials run on the cluster's free workers, pruned at their rungs.

study: the study, its sampler and pruner; storage: where the study lives (a journal file in
the artifact root); resume: taking over a study a killed flow left; referee: the per-epoch
verdicts the ranks wait for; board: what is running and done, for Prefect's progress
artifact; plots: Optuna's plots for the parent MLflow run; run: the search loop itself.
"""
