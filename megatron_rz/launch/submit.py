"""`rz submit RECIPE [overrides] [--dry-run]`: run a recipe as one heterogeneous SLURM job.

The recipe (with its overrides) is resolved and planned first (megatron_rz.launch.planner): a layout that
cannot run fails here, before anything is written or submitted. Then the resolved recipe and the
sbatch script rendered from slurm/job.sbatch.j2 are written under cluster.log_dir, and `sbatch`
submits the script (or --dry-run prints it with the memory plan).

Per job: the log is <log_dir>/<job name>-<job id>.out (appended across requeues), the run dir
<run_root>/<recipe name>-<job id> (or --run-dir, to continue an earlier run in a new job).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rz.launch.planner import Plan, format_plan, make_plan
from megatron_rz.rl.tasks import describe_task
from megatron_rz.recipe import Recipe, RecipeError, dump_recipe
from megatron_rz.launch.runtime import child_env

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "job.sbatch.j2"

# Multi-node GPU environment (cluster.env entries override these).
GPU_ENV = {
    # Megatron's tensor/sequence-parallel overlap needs kernels launched in issue order.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # A failed or stuck NCCL collective ends the job instead of hanging it until the time limit.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
    # vLLM workers must not fork a process that has initialised CUDA.
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
}


class SubmitError(RecipeError):
    """sbatch refused the job or is missing."""


@dataclass
class Rendered:
    script: str
    plan: Plan
    job_name: str
    workdir: Path
    log_dir: Path
    recipe_file: Path  # where the resolved recipe goes (the job reads it)
    script_file: Path
    run_dir: str  # "{job}" stands for the job id

    def run_dir_for(self, job_id: str) -> Path:
        return Path(self.run_dir.format(job=job_id))


def _abs(path: str, workdir: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else workdir / p


def rollout_tasks(recipe: Recipe) -> dict:
    """How the rollout component's processes map onto engines (one `vllm serve` per process).

    An engine's width is tensor_parallel_size x pipeline_parallel_size GPUs.
    tasks_per_node  servers per node: GPUs per node / width when an engine is
                    smaller than a node (each server sees only its engine's GPUs), else 1
    engine_nodes    nodes per engine: width / GPUs per node when an engine is wider
                    than a node (the first node's server serves it, the others run its workers:
                    vLLM's multi-node mode, `vllm serve --nnodes K --node-rank R --headless`)
    hosts           servers that serve an engine to the learner
    procs           rollout processes in all"""
    c, r = recipe.cluster, recipe.rollout
    gpn, tp = c.rollout.gpus_per_node, r.tensor_parallel_size * r.pipeline_parallel_size
    tasks = gpn // tp if gpn and tp < gpn else 1
    engine_nodes = tp // gpn if gpn and tp > gpn else 1
    return {"tasks_per_node": tasks, "engine_nodes": engine_nodes,
            "hosts": c.rollout.nodes * tasks // engine_nodes, "procs": c.rollout.nodes * tasks}


def _group_sbatch(recipe: Recipe, which: str) -> list[str]:
    c = recipe.cluster
    g = getattr(c, which)
    lines = []
    partition = g.partition or c.partition
    if partition:
        lines.append(f"--partition={partition}")
    if c.account:
        lines.append(f"--account={c.account}")
    if c.qos:
        lines.append(f"--qos={c.qos}")
    tasks = rollout_tasks(recipe)["tasks_per_node"] if which == "rollout" else 1
    lines += [f"--nodes={g.nodes}", f"--ntasks-per-node={tasks}"]
    if g.gpus_per_node:
        lines.append(f"--gpus-per-node={g.gpus_per_node}")
    if g.cpus_per_task:
        lines.append(f"--cpus-per-task={g.cpus_per_task}")
    if g.mem is not None:
        lines.append(f"--mem={g.mem}")
    if g.constraint:
        lines.append(f"--constraint={g.constraint}")
    return lines


def _srun_opts(recipe: Recipe, which: str, workdir: Path, one_task: bool = False) -> str:
    c = recipe.cluster
    g = getattr(c, which)
    tasks = rollout_tasks(recipe)["tasks_per_node"] if which == "rollout" else 1
    opts = ["--nodes=1", "--ntasks=1"] if one_task else [f"--nodes={g.nodes}", f"--ntasks-per-node={tasks}"]
    if which == "learner" and not one_task:
        opts.append("--kill-on-bad-exit=1")
    if g.gpus_per_node and tasks > 1:  # one engine per task, each on its own GPUs
        opts.append(f"--gpus-per-task={recipe.rollout.tensor_parallel_size * recipe.rollout.pipeline_parallel_size}")
    elif g.gpus_per_node:
        opts.append(f"--gpus-per-node={g.gpus_per_node}")
    if g.cpus_per_task:  # srun does not inherit sbatch's --cpus-per-task (SLURM >= 22.05)
        opts.append(f"--cpus-per-task={g.cpus_per_task}")
    if c.container_image:  # pyxis/enroot
        opts.append(f"--container-image={shlex.quote(c.container_image)}")
        opts.append(f"--container-workdir={shlex.quote(str(workdir))}")
        if c.mounts:
            opts.append(f"--container-mounts={shlex.quote(','.join(c.mounts))}")
    return " ".join(opts)


def render(recipe: Recipe, *, workdir: Path | None = None, run_dir: str | None = None,
           stamp: str | None = None) -> Rendered:
    """The sbatch script for `recipe`; raises PlanError first. Writes nothing."""
    import jinja2

    plan = make_plan(recipe)
    c = recipe.cluster
    workdir = Path(c.workdir or workdir or Path.cwd()).resolve()
    log_dir = _abs(c.log_dir, workdir)
    job_name = c.job_name or f"rz-{recipe.name}"
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    recipe_file = log_dir / f"{job_name}-{stamp}.yaml"
    if run_dir:
        run_dir_expr = shlex.quote(str(_abs(run_dir, workdir)))
        run_dir_pattern = str(_abs(run_dir, workdir)).replace("{", "{{").replace("}", "}}")
    else:
        run_dir_expr = shlex.quote(str(_abs(c.run_root, workdir) / recipe.name)) + '-"$SLURM_JOB_ID"'
        run_dir_pattern = str(_abs(c.run_root, workdir) / recipe.name).replace("{", "{{").replace("}", "}}") + "-{job}"
    python = c.python
    if "/" in python and not Path(python).is_absolute():
        python = str(workdir / python)
    gpu = c.learner.gpus_per_node > 0 or c.rollout.gpus_per_node > 0
    # runtime.* reach every task (learner ranks and the vllm serve processes) as megatron_rz.launch.runtime exports them
    env = {**(GPU_ENV if gpu else {}), **child_env(recipe), **c.env}
    if gpu:  # per-job compiler caches: kernels compiled by one job never race another's
        env.setdefault("TRITON_CACHE_DIR", "/tmp/rz-$SLURM_JOB_ID/triton")
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/rz-$SLURM_JOB_ID/inductor")

    def env_value(v: str) -> str:  # $SLURM_JOB_ID-style references stay live, the rest literal
        return f'"{v}"' if v.startswith("/tmp/rz-$SLURM_JOB_ID/") else shlex.quote(v)

    def desc(g) -> str:
        return (f"{g.nodes} node(s) x {g.gpus_per_node} GPU(s)" if g.gpus_per_node else f"{g.nodes} CPU node(s)")

    tmpl = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    tmpl.filters["q"] = lambda v: shlex.quote(str(v))
    script = tmpl.from_string(TEMPLATE.read_text()).render(
        recipe_name=recipe.name,
        c=c,
        job_name=job_name,
        log_dir=log_dir,
        learner_desc=f"{desc(c.learner)}, {plan.learner_ranks} ranks, tp={recipe.parallel.tp} "
        f"pp={recipe.parallel.pp} dp={recipe.parallel.dp} ep={recipe.parallel.ep}",
        rollout_desc=f"{desc(c.rollout)}, {recipe.rollout.num_engines} engine(s) x "
        f"tensor_parallel_size={recipe.rollout.tensor_parallel_size}"
        + (f" x pipeline_parallel_size={recipe.rollout.pipeline_parallel_size}"
           if recipe.rollout.pipeline_parallel_size > 1 else ""),
        task_desc=describe_task(recipe.task),
        learner_sbatch=_group_sbatch(recipe, "learner"),
        rollout_sbatch=_group_sbatch(recipe, "rollout"),
        workdir=workdir,
        run_dir_expr=run_dir_expr,
        env=[(k, env_value(v)) for k, v in env.items()],
        setup="\n".join(c.setup),
        python=python,
        recipe_file=recipe_file,
        rollout_srun=_srun_opts(recipe, "rollout", workdir),
        learner_srun=_srun_opts(recipe, "learner", workdir),
        prepare_srun=_srun_opts(recipe, "learner", workdir, one_task=True),
        engine_args=json.dumps({k: v for k, v in recipe.engine_kwargs().items() if k != "aligned"}),
        aligned_flag="--aligned" if recipe.mode == "aligned" else "--no-aligned",
        wait_s=int(recipe.rollout.server_wait_s),
        rollout_prefix='export VLLM_HOST_IP=$(hostname -I | cut -d" " -f1); ' if c.rollout.gpus_per_node else "",
        learner_nodes=c.learner.nodes,
        rollout=rollout_tasks(recipe),
        procs_per_node=plan.learner_ranks_per_node,
    )
    return Rendered(script=script, plan=plan, job_name=job_name, workdir=workdir, log_dir=log_dir,
                    recipe_file=recipe_file, script_file=log_dir / f"{job_name}-{stamp}.sbatch",
                    run_dir=run_dir_pattern)


def submit(recipe: Recipe, *, dry_run: bool = False, run_dir: str | None = None, sbatch: str = "sbatch",
           out=print) -> str | None:
    """Plan, write and (unless dry_run) submit; returns the job id."""
    r = render(recipe, run_dir=run_dir)  # a layout that cannot run stops here: nothing written
    plan_text = format_plan(r.plan, recipe)
    if dry_run:
        out(r.script)
        out(plan_text)
        return None
    from megatron_rz.launch.rundir import writable_dirs

    # the directories the job writes: refused in one line before anything is written or submitted
    runs = ((run_dir if "{" not in run_dir else Path(run_dir.split("{")[0]).parent, "--run-dir") if run_dir
            else (_abs(recipe.cluster.run_root, r.workdir), "cluster.run_root"))
    writable_dirs([runs, (r.log_dir, "cluster.log_dir")])
    dump_recipe(recipe, r.recipe_file)  # the job runs exactly this (overrides applied)
    r.script_file.write_text(r.script)
    out(plan_text)
    try:
        res = subprocess.run([sbatch, "--parsable", str(r.script_file)], capture_output=True, text=True,
                             cwd=r.workdir)
    except FileNotFoundError:
        raise SubmitError(f"{sbatch!r} not found: run rz submit where SLURM's client commands are installed "
                          "(slurm/start_local.sh starts a local cluster)") from None
    if res.returncode != 0:
        raise SubmitError(f"sbatch refused {r.script_file}: {res.stderr.strip() or res.stdout.strip()}")
    job_id = res.stdout.strip().split(";")[0]
    out(f"submitted job {job_id}: script {r.script_file}, log {r.log_dir}/{r.job_name}-{job_id}.out, "
        f"run dir {r.run_dir_for(job_id)}")
    return job_id


def prepare(recipe_file: str, run_dir: str) -> Path:
    """The batch script's first step (`python -m megatron_rz.launch.submit prepare RECIPE RUN_DIR`): the
    checkpoint the rollout servers serve, made (or found) exactly as the learner does, its path
    written to RUN_DIR/rollout/model_dir."""
    from megatron_rz.recipe import load_recipe
    from megatron_rz.launch.rundir import prepare_base_model

    recipe = load_recipe(recipe_file, [f"logging.run_dir={run_dir}"])
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(prepare_base_model(recipe, out)).resolve()
    dest = out / "rollout" / "model_dir"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(".model_dir.tmp")
    tmp.write_text(f"{base}\n")
    tmp.replace(dest)
    print(f"[rz job] base model for the rollout servers: {base}", flush=True)
    return base


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "prepare":
        print("usage: python -m megatron_rz.launch.submit prepare RECIPE_FILE RUN_DIR", file=sys.stderr)
        return 2
    try:
        prepare(argv[1], argv[2])
    except RecipeError as e:
        print(f"[rz job] {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
