"""Each flow's parameter defaults, the one place they are written.

A parameter's type, bounds and help are declared in flows.params (ddpflow.param_types for
the shared ones); its default can differ between flows (keep_last, experiment) and is set
here, per flow, in the flow's parameter order. The flows' signatures, Prefect's parameter
schema, the command line and the generated parameter tables (flows.param_docs) all read
these. Flows that share a training share its defaults by building on the same mapping.
"""

from __future__ import annotations

from typing import Any

from ddpflow.checkpoint.steps import DEFAULT_CHECKPOINT_EVERY_S
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH

TRAIN_CHARLM: dict[str, Any] = {
    "source": str(DEFAULT_CORPUS_PATH),
    "epochs": 3,
    "batch_size": 512,
    "global_batch": False,
    "lr": 0.005,
    "hidden_size": 128,
    "num_layers": 4,
    "dropout": 0.1,
    "world_size": None,
    "seed": 0,
    "holdout_fraction": 0.1,
    "data_layout": "auto",
    "stream_above_mb": 2048.0,
    "shard_mb": 64.0,
    "keep_last": 3,
    "checkpoint_every_steps": 0,
    "checkpoint_every_s": DEFAULT_CHECKPOINT_EVERY_S,
    "num_names": 10,
    "rank_timeout_s": 120.0,
    "model_name": "ddpflow-charlm",
    "experiment": "ddpflow-charlm",
    "max_restarts": 2,
    "min_workers": None,
    "max_workers": None,
    "precision": "auto",
    "pin_memory": "auto",
    "compile": False,
}

# The challenger trains as train-charlm does; `margin` is the promotion rule's own.
RETRAIN_CHARLM: dict[str, Any] = {**TRAIN_CHARLM, "margin": 0.0}


def _pick(defaults: dict[str, Any], *names: str) -> dict[str, Any]:
    return {name: defaults[name] for name in names}


# A sweep's per-trial defaults are train-charlm's; trials train at fp32, unpinned, uncompiled.
SWEEP_CHARLM: dict[str, Any] = {
    "source": TRAIN_CHARLM["source"],
    "grid": None,
    "trials": None,
    **_pick(TRAIN_CHARLM, "epochs", "batch_size", "lr", "hidden_size", "num_layers", "dropout"),
    "seed": TRAIN_CHARLM["seed"],
    "ranks_per_trial": 1,
    "holdout_fraction": TRAIN_CHARLM["holdout_fraction"],
    "keep_last": 1,
    "rank_timeout_s": TRAIN_CHARLM["rank_timeout_s"],
    "model_name": TRAIN_CHARLM["model_name"],
    "experiment": "ddpflow-charlm-sweep",
    "promote": False,
}

# A scaling run sets the world size per child and evaluates or registers nothing, so it
# has no world_size, min_workers, max_workers, num_names or model_name; it keeps one checkpoint.
SCALING_CHARLM: dict[str, Any] = {
    "source": TRAIN_CHARLM["source"],
    "world_sizes": None,
    "target_loss": None,
    **_pick(
        TRAIN_CHARLM,
        "epochs",
        "batch_size",
        "lr",
        "hidden_size",
        "num_layers",
        "dropout",
        "seed",
        "holdout_fraction",
        "data_layout",
        "stream_above_mb",
        "shard_mb",
    ),
    "keep_last": 1,
    **_pick(TRAIN_CHARLM, "rank_timeout_s", "max_restarts"),
    "experiment": "ddpflow-charlm-scaling",
    **_pick(TRAIN_CHARLM, "precision", "pin_memory", "compile"),
}

TRAIN_IMAGES: dict[str, Any] = {
    "source": None,
    "arch": "resnet18",
    "weights": "none",
    "freeze_backbone": False,
    "image_size": 32,
    "resize": "crop",
    "val_fraction": 0.2,
    "epochs": 5,
    "batch_size": 32,
    "global_batch": False,
    "lr": 0.001,
    "optimizer": "adam",
    "lr_patience": 2,
    "world_size": None,
    "seed": 0,
    "max_bad_fraction": 0.01,
    "max_image_mb": 20.0,
    "data_layout": "auto",
    "stream_above_mb": 2048.0,
    "shard_mb": 64.0,
    "augment": "auto",
    "keep_last": 3,
    "checkpoint_every_steps": 0,
    "checkpoint_every_s": DEFAULT_CHECKPOINT_EVERY_S,
    "rank_timeout_s": 120.0,
    "max_restarts": 2,
    "min_workers": None,
    "max_workers": None,
    "model_name": "ddpflow-images",
    "experiment": "ddpflow-images",
    "precision": "auto",
    "channels_last": "auto",
    "pin_memory": "auto",
    "compile": False,
}

SCALING_IMAGES: dict[str, Any] = {
    "source": TRAIN_IMAGES["source"],
    "world_sizes": None,
    "target_accuracy": None,
    **{
        k: v
        for k, v in TRAIN_IMAGES.items()
        if k not in ("source", "world_size", "min_workers", "max_workers", "model_name")
        and not k.startswith("checkpoint_every")
    },
    "keep_last": 1,
    "experiment": "ddpflow-images-scaling",
}
