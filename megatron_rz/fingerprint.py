"""Hashes of what a run computes: the recipe hash and the tiny base model's hash."""

from __future__ import annotations

import hashlib
import json

from megatron_rz.recipe import Recipe

# Fields that do not change what a run computes (compared when a run is resumed).
NOT_RESULTS = {"checkpoint": {"load", "verify"}, "logging": {"progress", "plots", "wandb", "wandb_mode", "verbose"},
               "parallel": {"collective_timeout_s"}, "runtime": {"gemm_small_tiles", "gemm_table", "native_cpu_kernels"}}
BASE_FORMAT = 1  # bump when warm_start changes what it makes from the same settings
# Task fields added after hashes were recorded: left out of both hashes while at their defaults, so
# the hashes of recipes that do not use them stay what they were.
LATER_TASK_DEFAULTS = {"max_turns": 4, "tool_timeout_s": 5.0, "tool_output_chars": 200, "tools": [],
                       "lag_bound": "token"}


def _task(d: dict) -> dict:
    return {k: v for k, v in d.items() if not (k in LATER_TASK_DEFAULTS and v == LATER_TASK_DEFAULTS[k])}


def digest(obj) -> str:
    """A short stable hash of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def base_model_hash(recipe: Recipe, seed: int) -> str:
    """Hash of everything the tiny base model is made from: model sizes and dtype, the task, the
    warm start and its seed (not model.fp8, applied per engine, nor model.pretrained)."""
    ws = recipe.warm_start.model_dump()
    if ws.get("device") == "cpu":  # the default before the field existed: earlier hashes still hold
        ws.pop("device")
    return digest({"format": BASE_FORMAT, "seed": int(seed), "task": _task(recipe.task.model_dump()),
                   "warm_start": ws,
                   "model": recipe.model.model_dump(exclude={"pretrained", "fp8"})})


def recipe_hash(recipe: Recipe) -> str:
    """Hash of the resolved recipe without the fields in NOT_RESULTS."""
    d = recipe.model_dump()
    d["task"] = _task(d["task"])
    for section, keys in NOT_RESULTS.items():
        for k in keys:
            d[section].pop(k, None)
    return digest(d)
