"""`rz submit`: the rendered sbatch script, --dry-run, and refusals before anything is submitted."""

import subprocess
from pathlib import Path

import pytest

from megatron_rz.cli import main
from megatron_rz.recipe import load_recipe
from megatron_rz.launch.submit import render

ROOT = Path(__file__).resolve().parents[2]
FULL = ["r1_distill_qwen_1p5b", "qwen3_30b_a3b", "deepseek_v3_671b", "deepseek_v4_flash"]


def _sbatch_lines(script: str) -> tuple[list[str], list[str]]:
    """(#SBATCH options of the learner component, of the rollout component)."""
    opts = [ln.removeprefix("#SBATCH ").strip() for ln in script.splitlines() if ln.startswith("#SBATCH")]
    i = opts.index("hetjob")
    return opts[:i], opts[i + 1:]


@pytest.mark.parametrize("name", FULL)
def test_dry_run_prints_script_and_memory_plan(name, capsys, tmp_path):
    path = ROOT / "recipes" / f"{name}.yaml"
    assert main(["submit", str(path), f"cluster.log_dir={tmp_path}/logs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    script, _, plan = out.partition("memory plan:")
    r = load_recipe(path)
    c, p = r.cluster, r.parallel
    learner, rollout = _sbatch_lines(script)
    for opt in (f"--time={c.time_limit}", f"--signal=B:USR1@{c.signal_warning_s}", "--requeue",
                f"--nodes={c.learner.nodes}", f"--gpus-per-node={c.learner.gpus_per_node}", "--ntasks-per-node=1",
                f"--job-name=rz-{name}", "--open-mode=append"):
        assert opt in learner, (opt, learner)
    assert f"--nodes={c.rollout.nodes}" in rollout and f"--gpus-per-node={c.rollout.gpus_per_node}" in rollout
    assert any(o.startswith("--output=") and o.endswith("/%x-%j.out") for o in learner)
    # one torchrun per learner node, one rank per GPU, rendezvous at the first learner node
    assert f"--nnodes={c.learner.nodes} --nproc-per-node={c.learner.gpus_per_node}" in script
    assert c.learner.nodes * c.learner.gpus_per_node == p.tp * p.pp * p.dp
    assert "srun --het-group=0" in script and "srun --het-group=1" in script
    assert '--rdzv-endpoint="$RZ_HEAD_ADDR:$RZ_RDZV_PORT"' in script
    assert "checkpoint.load=latest" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script and "export VLLM_HOST_IP=" in script
    # the recipe's runtime section reaches every task, the vllm serve processes included
    assert "export RZ_KERNELS=auto" in script and "export RZ_VLLM_PATCHES=1" in script
    # the plan: parameters, both sides' memory against the GPU budget
    assert "parameters: total" in plan and f"GiB per GPU of {c.learner.gpu_memory_gb:g}" in plan
    assert "KV cache holds" in plan
    # nothing written by a dry run
    assert not (tmp_path / "logs").exists()
    # a script bash accepts
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    assert subprocess.run(["bash", "-n", str(f)], capture_output=True).returncode == 0


def test_cpu_only_cluster_renders_process_ranks_without_gpu_options():
    r = load_recipe(ROOT / "recipes" / "tiny_moe.yaml", ["parallel.dp=2", "cluster.learner.nodes=2"])
    out = render(r, workdir=ROOT)
    learner, rollout = _sbatch_lines(out.script)
    assert "--nodes=2" in learner and not any("gpus" in o for o in learner + rollout)
    assert "--nnodes=2 --nproc-per-node=1" in out.script
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out.script


def test_container_mounts_setup_and_extra_options_reach_the_script():
    r = load_recipe(ROOT / "recipes" / "qwen3_30b_a3b.yaml", [
        "cluster.container_image=nvcr.io/nvidia/pytorch:25.10-py3", "cluster.mounts=[/lustre:/lustre, /home:/home:ro]",
        "cluster.setup=[module load cuda/12.8]", "cluster.partition=gpu", "cluster.account=proj42",
        "cluster.sbatch_extra=[--mail-type=END]", "cluster.env={NCCL_SOCKET_IFNAME: ib0}", "cluster.requeue=false",
    ])
    s = render(r, workdir=ROOT).script
    learner, rollout = _sbatch_lines(s)
    assert {"--partition=gpu", "--account=proj42", "--mail-type=END", "--no-requeue"} <= set(learner)
    assert {"--partition=gpu", "--account=proj42"} <= set(rollout)
    assert "--container-image=nvcr.io/nvidia/pytorch:25.10-py3" in s
    assert "--container-mounts=/lustre:/lustre,/home:/home:ro" in s
    assert "export RZ_SETUP='module load cuda/12.8'" in s and "export NCCL_SOCKET_IFNAME=ib0" in s


def test_resubmission_reuses_a_run_dir():
    r = load_recipe(ROOT / "recipes" / "tiny_moe.yaml")
    out = render(r, workdir=ROOT, run_dir="runs/slurm/tiny_moe-41")
    assert f"export RZ_RUN_DIR={ROOT}/runs/slurm/tiny_moe-41\n" in out.script
    assert out.run_dir_for("99") == ROOT / "runs/slurm/tiny_moe-41"
    assert render(r, workdir=ROOT).run_dir_for("7") == ROOT / "runs/slurm/tiny_moe-7"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["parallel.dp=16"], "4*1*16 = 64 ranks, but cluster.learner has 1 nodes x 8 GPUs = 8"),
        (["parallel.ep=1"], "learner needs"),
        (["cluster.time_limit=1:2:3:4"], "is a number: quote it"),
        (["cluster.time_limit=1-2:3:4:5"], "not a SLURM time"),
    ],
)
def test_refused_before_anything_is_written_or_submitted(overrides, fragment, tmp_path, capsys):
    logs = tmp_path / "logs"
    # sbatch is never reached: this one would fail loudly if it were
    rc = main(["submit", str(ROOT / "recipes" / "qwen3_30b_a3b.yaml"), f"cluster.log_dir={logs}", *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and "Traceback" not in err
    assert not logs.exists()


def test_overrides_may_follow_flags(capsys, tmp_path):
    path = ROOT / "recipes" / "deepseek_v4_flash.yaml"
    assert main(["submit", str(path), "--dry-run", f"cluster.log_dir={tmp_path}/after_flag"]) == 0
    assert f"{tmp_path}/after_flag" in capsys.readouterr().out
    # a word that is neither a flag nor key=value is still refused (one line, exit code 2)
    assert main(["submit", str(path), "--dry-run", "not-an-override"]) == 2
    assert "not-an-override" in capsys.readouterr().err


def test_rollout_nodes_run_vllm_serve_for_both_trainers(tmp_path):
    """Key (0600), the base model prepared before the servers, `vllm serve` (vllm_bridge.serve) with
    the recipe's engine arguments on every rollout node, the learner waits for every server's record
    and runs with rollout.where=servers; the same rollout side for max_lag 0 and max_lag > 0."""
    import json
    import shlex

    for overrides in ([], ["schedule.max_lag=2"]):
        r = load_recipe(ROOT / "recipes" / "tiny_moe.yaml", overrides)
        script = render(r, workdir=ROOT).script
        assert "umask 077" in script and '"$RZ_RUN_DIR/rollout.key"' in script
        assert "RZ_REMOTE_ROLLOUT" not in script and "RZ_ROLLOUT_" not in script and "rollout_host" not in script
        assert 'rm -rf "$RZ_RUN_DIR/rollout"' in script
        assert '-m megatron_rz.launch.submit prepare "$RZ_RECIPE_FILE" "$RZ_RUN_DIR"' in script
        assert '-m vllm_bridge.serve "$(cat "$RZ_RUN_DIR/rollout/model_dir")"' in script and "--aligned" in script
        assert '--record "$RZ_RUN_DIR/rollout/servers/$NAME.json"' in script and "--nnodes 1" not in script and "MULTI=()" in script
        line = next(ln for ln in script.splitlines() if ln.startswith("export RZ_ENGINE_ARGS="))
        args = json.loads(shlex.split(line.split("=", 1)[1])[0])
        assert args == {k: v for k, v in r.engine_kwargs().items() if k != "aligned"}
        assert "rollout.where=servers" in script
        # prepare, then the servers, then the wait loop, then the learner's srun
        order = [script.index(x) for x in ('-m megatron_rz.launch.submit prepare', '"$RZ_PYTHON" -m vllm_bridge.serve',
                                           "rollout server(s) ready after", "megatron_rz.cli train")]
        assert order == sorted(order)
        f = tmp_path / "job.sbatch"
        f.write_text(script)
        assert subprocess.run(["bash", "-n", str(f)], capture_output=True).returncode == 0
        lines = []
        from megatron_rz.launch.submit import submit

        submit(r, dry_run=True, out=lines.append)
        assert "warning" not in lines[-1]


def test_engine_wider_than_a_node_uses_vllm_multinode_mode():
    r = load_recipe(ROOT / "recipes" / "tiny_moe.yaml", [
        "mode=fast", "cluster.rollout.nodes=4", "cluster.rollout.gpus_per_node=2", "cluster.rollout.gpu_memory_gb=141",
        "rollout.tensor_parallel_size=4", "rollout.num_engines=2"])
    script = render(r, workdir=ROOT).script
    assert "RANK=$(( SLURM_NODEID % 2 ))" in script and "--nnodes 2 --node-rank \"$RANK\"" in script
    assert "--no-aligned" in script
    assert "while (( $(ls \"$RZ_RUN_DIR\"/rollout/servers/*.json 2>/dev/null | wc -l) < 2 ))" in script  # 2 heads


def test_serve_command_line(tmp_path):
    """vllm_bridge.serve: the in-process engine's settings as `vllm serve` options (no vLLM start)."""
    import os

    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from vllm_bridge.serve import cli_options, serve_command

    assert cli_options({"model": "/m", "enforce_eager": True, "enable_chunked_prefill": False, "seed": 3,
                        "hf_overrides": {"architectures": ["X"]}, "attention_backend": None}) == [
        "/m", "--enforce-eager", "--no-enable-chunked-prefill", "--seed", "3", "--hf-overrides",
        '{"architectures": ["X"]}']
    pytest.importorskip("vllm")
    ckpt = tmp_path / "ckpt"
    make_random_checkpoint(load_recipe(ROOT / "recipes" / "tiny_moe.yaml", []), ckpt)
    key = tmp_path / "key"
    key.write_text("k\n")
    os.chmod(key, 0o644)
    with pytest.raises(SystemExit, match="readable by others"):
        serve_command(str(ckpt), port=1, key_file=str(key))
    os.chmod(key, 0o600)
    argv, env = serve_command(str(ckpt), port=8123, key_file=str(key), engine_args={"max_model_len": 64})
    assert argv[:2] == ["serve", str(ckpt)] and "--no-enable-chunked-prefill" in argv
    assert argv[argv.index("--hf-overrides") + 1] == '{"architectures": ["RZAlignedQwen3MoeForCausalLM"]}'
    assert argv[argv.index("--api-key") + 1] == "k" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--middleware") + 1] == "vllm_bridge.server_routes.RequireKey"
    assert env["RZ_ALIGNED_SAMPLER"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    argv, _ = serve_command(str(ckpt), port=1, key_file=str(key), nnodes=2, node_rank=1, master_addr="h", master_port=5)
    assert "--headless" in argv and "--api-key" not in argv and argv[argv.index("--node-rank") + 1] == "1"
