"""Shared test policy: GPU tests skip without CUDA; `slow` tests are opt-in (RZ_SLOW=1); the files
that take minutes run first."""

import os

import pytest


# Test files that take minutes (make test's --durations on the 2-core CI box), longest first. They
# are collected first, so pytest-xdist's loadfile scheduler hands them out before the short files
# (longest-processing-time-first): no long file starts last and runs alone at the end.
LONG_FIRST = (  # seconds of test time per file (the 80 slowest phases), make test on the 2-core AVX-512 box, 2026-12-06
    "integration/test_check.py",  # 679
    "integration/test_async.py",  # 604
    "integration/test_train_e2e.py",  # 552
    "slurm/test_slurm_jobs.py",  # 542 (two jobs then; one job since 2026-12-07: 199 s alone)
    "integration/test_dsv4_aligned.py",  # 355
    "integration/test_remote_rollout.py",  # 306
    "integration/test_fp8_models.py",  # 231
    "integration/test_kimi_k3_learner.py",  # 223
    "integration/test_learner.py",  # 193
    "integration/test_ckpt_layout.py",  # 176
    "integration/test_verify_sync.py",  # 165
    "integration/test_aligned_vllm_tp.py",  # 146
    "integration/test_aligned_learner.py",  # 133
    "integration/test_reshard.py",  # 124
    "integration/test_pretrained.py",  # 121
    "integration/test_aligned_vllm.py",  # 113
    "integration/test_tasks_e2e.py",  # 111
    "integration/test_rollout.py",  # 111
    "integration/test_aligned_vllm_tp_fp8.py",  # 106
    "integration/test_reliability_dead_engine.py",  # 105
    "integration/test_agentic_e2e.py",  # 103
    "integration/test_dsv4_fp8.py",  # 79
    "integration/test_dsv4_fast.py",  # 78
    "integration/test_fp8_dsv3_learner_tp.py",  # 71
    "integration/test_aligned_vllm_tp_dsv4.py",  # 67
    "integration/test_aligned_vllm_dsv41.py",  # 60
    "integration/test_aligned_vllm_tp_dsv3.py",  # 49
    "integration/test_aligned_vllm_pp.py",  # 49
)


def _long_first_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].replace("\\", "/")
    for i, name in enumerate(LONG_FIRST):
        if path.endswith(name):
            return i
    return len(LONG_FIRST)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=_long_first_rank)  # stable: each file's tests stay together and in order

    no_cuda = pytest.mark.skip(reason="needs CUDA (run on the GPU machine; results in benchmarks/)")
    not_slow = pytest.mark.skip(reason="opt-in long test: set RZ_SLOW=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "slow" in item.keywords and os.environ.get("RZ_SLOW") != "1":
            item.add_marker(not_slow)


@pytest.fixture(scope="session")
def shared_base_model(tmp_path_factory):
    """``make(recipe, overrides) -> Path``: the warm-started base model of that recipe and those
    overrides, built once per test session and shared by the xdist workers (a file lock; the
    directory sits beside the workers' temp dirs). A test copies it into its run directory as
    RUN_DIR/base_model, which the trainer then uses as it uses any earlier run's base model (it
    checks the base-model hash and builds a new one on a mismatch). The warm start itself stays
    tested: the first test to ask builds it through megatron_rz.launch.rundir.build_base_model."""
    from pathlib import Path

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared_base_models"
    root.mkdir(parents=True, exist_ok=True)

    def make(recipe: str | Path, overrides: list[str] | tuple[str, ...]) -> Path:
        from megatron_rz.fingerprint import base_model_hash
        from megatron_rz.launch.rundir import build_base_model
        from megatron_rz.recipe import load_recipe

        r = load_recipe(recipe, list(overrides))
        key = base_model_hash(r, r.schedule.seed)
        target = root / key
        with FileLock(str(root / f"{key}.lock")):
            if not (target / "config.json").exists():
                build_base_model(r, target, progress=False)
        return target

    return make
