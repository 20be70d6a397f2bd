"""The bad-input battery: every wrong recipe file, key, value, flag or run directory ends as ONE line
on stderr naming the problem, exit code 2, no traceback, and nothing written or deleted.

Every case calls the CLI's `main` in-process (it must fail before any engine, Megatron or torch
import), from an empty working directory whose tree is compared before and after."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rz import cli
from refusal import assert_refused

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_moe.yaml")

FILES = {
    "notyaml.yaml": "model: [1, 2\nalgo: {lr: 3\n",
    "empty.yaml": "",
    "comments.yaml": "# only a comment\n",
    "list.yaml": "- model\n- algo\n",
    "scalar.yaml": "42\n",
    "typo.yaml": "rollout:\n  temperture: 0.7\n",
    "wrongtype.yaml": "algo:\n  lr: fast\n",
    "section_scalar.yaml": "model: 3\n",
    "neg_lr.yaml": "algo:\n  lr: -1\n",
    "intkey.yaml": "1: 2\n",
    "binary.yaml": b"\xff\xfe\x00\x81garbage",
    "run/metrics.jsonl": '{"step": 1, "reward_mean": 0.5}\n{"step": 2, "rew',  # truncated (killed writer)
    "foreign/metrics.jsonl": "[1, 2, 3]\n",
    "nonempty/keep.txt": "keep me\n",
}

# (argv, fragments that the one line must contain)
CASES = [
    # files that are no recipe
    (["validate", "notyaml.yaml"], ["not valid YAML", "line"]),
    (["train", "empty.yaml"], ["empty"]),
    (["validate", "comments.yaml"], ["empty"]),
    (["check", "list.yaml"], ["mapping", "list"]),
    (["validate", "scalar.yaml"], ["mapping", "int"]),
    (["validate", "binary.yaml"], ["not a text file"]),
    (["validate", "intkey.yaml"], ["top-level key 1"]),
    (["train", "missing.yaml"], ["not found"]),
    (["validate", "nonempty"], ["is a directory"]),
    # unknown keys and wrong types, in the file and as overrides
    (["train", "typo.yaml"], ["rollout.temperture", "temperature"]),
    (["validate", "wrongtype.yaml"], ["algo.lr='fast'", "valid number", "algo.lr=0.0001"]),
    (["validate", "section_scalar.yaml"], ["model=3", "section"]),
    (["train", TINY, "algo.learning_rate=1e-4"], ["algo.learning_rate", "valid keys", " lr,"]),
    (["validate", TINY, "foo.bar=1"], ["'foo.bar'", "valid keys"]),
    (["validate", TINY, "algo.lr.x=1"], ["algo.lr is a value"]),
    (["validate", TINY, "algo"], ["not key.path=value"]),
    (["validate", TINY, "=3"], ["not a key path"]),
    (["validate", TINY, "schedule.steps=ten"], ["schedule.steps='ten'", "integer"]),
    # ranges
    (["train", "neg_lr.yaml"], ["algo.lr=-1", "> 0"]),
    (["train", TINY, "algo.lr=0"], ["algo.lr=0", "> 0"]),
    (["train", TINY, "schedule.steps=0"], ["schedule.steps=0", ">= 1"]),
    (["bench", "rollout", TINY, "rollout.temperature=0"], ["rollout.temperature=0", "> 0"]),
    (["check", TINY, "rollout.top_p=0"], ["rollout.top_p", "(0, 1]"]),
    (["validate", TINY, "rollout.top_p=1.5"], ["rollout.top_p=1.5"]),
    (["train", TINY, "rollout.max_new_tokens=0"], ["rollout.max_new_tokens=0", ">= 1"]),
    (["validate", TINY, "rollout.kv_cache_gb=0"], ["rollout.kv_cache_gb=0", "> 0"]),
    (["validate", TINY, "rollout.samples_per_prompt=1"], ["samples_per_prompt", "group"]),
    (["validate", TINY, "rollout.where=remote"], ["rollout.where='remote'", "'local' or 'servers'"]),
    (["validate", TINY, "rollout.server_dead_after_s=90"], ["rollout.server_dead_after_s", "within 60 s"]),
    (["train", TINY, "model.hidden_size=0"], ["model.hidden_size=0", ">= 1"]),
    (["validate", TINY, "model.num_layers=-2"], ["model.num_layers=-2"]),
    (["validate", TINY, "algo.micro_batch_size=0"], ["algo.micro_batch_size=0"]),
    (["validate", TINY, "algo.adam_beta2=1.0"], ["algo.adam_beta2=1.0", "< 1"]),
    (["validate", TINY, "warm_start.lr=-0.1"], ["warm_start.lr=-0.1"]),
    (["validate", TINY, "task.eval_prompts=0"], ["task.eval_prompts=0"]),
    (["validate", TINY, "checkpoint.every=-1"], ["checkpoint.every=-1", ">= 0"]),
    (["validate", TINY, "checkpoint.keep=-1"], ["checkpoint.keep=-1", ">= 0"]),
    (["validate", TINY, "schedule.max_lag=-1"], ["schedule.max_lag=-1"]),
    (["validate", TINY, "algo.max_bad_updates=0"], ["algo.max_bad_updates=0"]),
    (["validate", TINY, "algo.icepop_low=3"], ["icepop_low=3", "icepop_high"]),
    (["validate", TINY, "task.ops=[]"], ["task.ops"]),
    # process settings (recipe runtime section and friends; were RZ_* environment variables)
    (["validate", TINY, "runtime.kernels=triton"], ["runtime.kernels='triton'", "'auto' or 'reference'",
                                                   "runtime.kernels=auto"]),
    (["train", TINY, "runtime.kernel=auto"], ["runtime.kernel'", "did you mean 'runtime.kernels'"]),
    (["validate", TINY, "runtime.gemm_small_tiles=sometimes"], ["runtime.gemm_small_tiles='sometimes'", "boolean"]),
    (["check", TINY, "runtime.gemm_table=/no/such/table.json"], ["runtime.gemm_table='/no/such/table.json'",
                                                                  "is not a file", "auto, off"]),
    (["check", TINY, "runtime.vllm_patches=2"], ["runtime.vllm_patches=2", "boolean", "runtime.vllm_patches=True"]),
    (["validate", TINY, "runtime=fast"], ["runtime='fast'", "section"]),
    (["bench", "rollout", TINY, "runtime.native_cpu_kernels=[1]"], ["runtime.native_cpu_kernels", "boolean"]),
    (["validate", TINY, "checkpoint.verify=md5"], ["checkpoint.verify='md5'", "'hash' or 'size'",
                                                  "checkpoint.verify=hash"]),
    (["train", TINY, "parallel.collective_timeout_s=0"], ["parallel.collective_timeout_s=0", "> 0",
                                                          "parallel.collective_timeout_s=null"]),
    (["validate", TINY, "logging.verbose=loud"], ["logging.verbose='loud'", "boolean"]),
    # sizes that do not fit together
    (["train", TINY, "parallel.ep=3"], ["ep*etp=3", "tp*dp"]),
    (["validate", TINY, "model.top_k=9"], ["top_k=9", "num_experts"]),
    (["validate", TINY, "model.num_experts=0"], ["num_experts=0", "top_k"]),
    (["validate", TINY, "model.arch=qwen2", "model.top_k=2"], ["arch=qwen2 is dense", "model.num_experts=0"]),
    (["validate", str(ROOT / "recipes" / "tiny_qwen2.yaml"), "model.head_dim=64"],
     ["head_dim = hidden_size / num_attention_heads", "model.head_dim=32"]),
    (["validate", str(ROOT / "recipes" / "tiny_qwen2.yaml"), "model.fp8=blockwise"], ["model.fp8=none for qwen2"]),
    (["validate", TINY, "model.vocab_size=8"], ["tokenizer_vocab", "vocab_size"]),
    (["validate", TINY, "rollout.max_new_tokens=500"], ["max_new_tokens=500", "max_position_embeddings"]),
    (["submit", TINY, "--dry-run", "model.head_dim=16"], ["head_dim=16"]),
    (["validate", TINY, "name=../elsewhere"], ["name='../elsewhere'"]),
    (["train", TINY, "logging.run_dir=runs/{oops}"], ["logging.run_dir", "{name}"]),
    # flags and the other commands
    (["check", TINY, "--prompts", "0"], ["--prompts", ">= 1"]),
    (["bench", "rollout", TINY, "--rounds", "x"], ["--rounds", "whole number"]),
    (["bench", "sideways", TINY], ["sideways"]),
    (["bench", "async", TINY, "--lags", "2,x"], ["--lags", "comma-separated"]),
    (["bench", "async", TINY, "--lags", "0"], ["--lags", ">= 1"]),
    (["frobnicate"], ["frobnicate"]),
    (["train"], ["required", "recipe"]),
    (["train", TINY, "--no-such-flag"], ["--no-such-flag"]),
    (["make-model", TINY, "--out", "nonempty"], ["--out nonempty", "not empty"]),
    (["make-model", TINY, "--out", "fresh", "warm_start.batch_size=0"], ["warm_start.batch_size=0"]),
    (["plot", "nowhere"], ["no metrics.jsonl"]),
    (["plot", "run"], ["line 2", "not JSON"]),
    (["plot", "foreign"], ["line 1", "not a metrics row"]),
    (["plot", "run", "foreign", "--labels", "a,b,c"], ["3 labels", "2 run dirs"]),
]
# a rollout TP the aligned vLLM class cannot shard (tiny_moe has 2 KV heads): refused before the warm start
CASES.append((["check", TINY, "rollout.tensor_parallel_size=4"],
              ["model.num_kv_heads=2", "rollout.tensor_parallel_size=4", "mode=fast"]))
if shutil.which("nvidia-smi") is None:  # a GPU recipe's warm start on a machine without CUDA
    CASES.append((["train", str(ROOT / "recipes" / "gpu_moe.yaml")], ["warm_start.device=cuda", "no CUDA device"]))


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    for name, text in FILES.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RZ_DEBUG", raising=False)
    return tmp_path


def test_battery_is_large_enough():
    assert len(CASES) >= 30 and {a[0] for a, _ in CASES} >= {
        "train", "check", "bench", "submit", "validate", "make-model", "plot"}


@pytest.mark.parametrize("argv, fragments", CASES, ids=[" ".join(a).replace(TINY, "tiny") for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_nothing_touched(workdir, capsys, argv, fragments):
    assert_refused(workdir, capsys, argv, fragments)


def test_stock_bf16_rollout_under_an_isa_cap_is_refused_before_anything_starts(workdir, capsys, monkeypatch):
    """Fast mode rolls out in stock vLLM-CPU: in bf16 on an AMX CPU its worker aborts under an
    ONEDNN_MAX_CPU_ISA cap without AMX, so the run is refused in one line before the warm start."""
    import torch

    if torch.cuda.is_available() or not torch.cpu._is_amx_tile_supported():
        pytest.skip("the refusal applies to a CPU with AMX tiles and no CUDA")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert_refused(workdir, capsys, ["check", TINY, "mode=fast", "rollout.dtype=bfloat16"],
                   ["ONEDNN_MAX_CPU_ISA=AVX2", "rollout.dtype=float32"])


def test_debug_shows_the_traceback(workdir, capsys):
    assert cli.main(["validate", TINY, "algo.lr=-1", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("rz: error: ")


def test_real_entry_point_prints_one_line(tmp_path):
    """The same through `python -m megatron_rz.cli` (what `rz` runs): no traceback, exit code 2."""
    (tmp_path / "empty.yaml").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RZ_DEBUG"}
    res = subprocess.run([sys.executable, "-m", "megatron_rz.cli", "train", "empty.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "empty" in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.yaml"]
