"""`rz`: the command line.

    rz train RECIPE [key.path=value ...]     run a recipe (torchrun is started for tp*dp > 1); a run dir
             [--overwrite]                   holding another run's results is refused (megatron_rz.launch.rundir)
    rz check RECIPE [overrides]              per-token logprob parity, vLLM vs learner
    rz bench rollout RECIPE [overrides]      rollout step time aligned vs fast (ratio, one run)
    rz bench async RECIPE [--lags 2,8] [overrides]  updates/s async (each max_lag) vs sync (ratios, one run)
    rz validate RECIPE [overrides]           check a recipe and print the resolved values
    rz make-model RECIPE --out DIR           tokenizer + tiny HF checkpoint + warm start
    rz plot RUN_DIR [RUN_DIR ... --out DIR]  redraw the PNG plots; several runs: overlay D3, reward, KL
    rz submit RECIPE [overrides] [--dry-run] run on SLURM (the recipe's cluster section; docs/slurm.md)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kernels.families import family
from megatron_rz.recipe import RecipeError, load_recipe


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipes/*.yaml")
    p.add_argument("overrides", nargs="*", default=[], help="key.path=value, e.g. algo.lr=3e-5 schedule.steps=10")


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"reinforce-zero: {summary['recipe']} ({summary['steps']} updates)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    t.add_row("held-out reward before", fmt(summary["eval_reward_before"]))
    t.add_row("held-out reward after", fmt(summary["eval_reward_after"]))
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    for key in after:  # every eval set's greedy / avg@k / pass@1 / pass@k (megatron_rz.rl.evaluation)
        t.add_row(f"held-out {key} before / after", f"{fmt(before.get(key))} / {fmt(after[key])}")
    if summary.get("reward_errors") or summary.get("reward_timeouts"):
        t.add_row("reward errors / timeouts (scored 0)", f"{summary['reward_errors']} / {summary['reward_timeouts']}")
    t.add_row("train reward first / last", f"{fmt(summary['train_reward_first'])} / {fmt(summary['train_reward_last'])}")
    t.add_row("max |dlogp| vLLM vs learner", fmt(summary["mismatch_max_abs_dlogp"]))
    t.add_row("mean |dlogp|", fmt(summary["mismatch_mean_abs_dlogp"]))
    t.add_row("tokens bitwise equal", f"{100 * summary['mismatch_frac_bitwise']:.1f}%")
    t.add_row("D3 (mean over updates)", fmt(summary["d3_mean"]))
    t.add_row("D3 peak / median", fmt(summary.get("d3_peak_over_median")))
    t.add_row("KL k1 first / last 10% of updates",
              f"{fmt(summary.get('kl_k1_first_10pct'))} / {fmt(summary.get('kl_k1_last_10pct'))}")
    t.add_row("max grad norm (before clipping)", fmt(summary.get("grad_norm_max")))
    if summary.get("max_lag"):
        t.add_row("policy lag mean / max", f"{fmt(summary.get('lag_mean'))} / {fmt(summary.get('lag_max'))}")
    for k, v in summary["time_per_step"].items():
        t.add_row(f"time/step {k} (s)", f"{v:.3f}")
    t.add_row("learner layers", str(summary.get("learner_spec")))
    t.add_row("run dir", summary["run_dir"])
    Console().print(t)


def _relaunch_under_torchrun(recipe, argv: list[str]) -> int | None:
    """Learner layouts with several ranks run as CPU (gloo) processes under torchrun."""
    world = recipe.parallel.world_size
    if world == 1 or "LOCAL_RANK" in os.environ:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "megatron_rz.cli", *argv]
    print(f"[rz] launching {world} learner ranks: {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd)


def _claim(recipe, args):
    """The run dir for this run (megatron_rz.launch.rundir), claimed once per run: by this process, or under
    torchrun by global rank 0 unless the `rz` that started torchrun holds it already."""
    from megatron_rz.launch.rundir import claim_run_dir

    if os.environ.get("RZ_RUN_DIR_CLAIMED") == str(recipe.run_dir.resolve()) or os.environ.get("RANK", "0") != "0":
        return None
    lock = claim_run_dir(recipe, overwrite=args.overwrite, argv=["train", args.recipe, *args.overrides])
    os.environ["RZ_RUN_DIR_CLAIMED"] = str(recipe.run_dir.resolve())  # for the torchrun ranks
    return lock


def _train_or_stop(train, recipe):
    """train(recipe); a dead or silent rollout engine, a failed weight-sync check or a full disk
    becomes one line naming the checkpoint to resume from (the run stops: it does not restart the
    engine)."""
    from megatron_rz.loop.rollout_process import RolloutProcessError
    from megatron_rz.rl.guards import RunStopped
    from megatron_rz.loop.resume import latest_checkpoint
    from vllm_bridge.engine import RolloutEngineError, WeightSyncError

    import errno

    try:
        return train(recipe)
    except (RolloutEngineError, RolloutProcessError, WeightSyncError, OSError) as e:
        if isinstance(e, OSError) and not isinstance(e, (RolloutEngineError, RolloutProcessError)) \
                and e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise  # other I/O errors keep their traceback
        ckpt = latest_checkpoint(recipe.run_dir, log=lambda m: None)
        where = f"the newest complete checkpoint is {ckpt}" if ckpt else "there is no checkpoint yet (it starts over)"
        raise RunStopped(f"{type(e).__name__}: {e} -- the run stopped; {where}: resume with "
                         f"`rz train ... checkpoint.load=latest`") from e


def _load(args):
    """The recipe of a command that runs something, its process settings applied (megatron_rz.launch.runtime)."""
    from megatron_rz.launch.runtime import apply_runtime

    recipe = load_recipe(args.recipe, args.overrides)
    apply_runtime(recipe)
    from megatron_rz.launch.planner import check_rollout_tp

    check_rollout_tp(recipe)  # a rollout TP the aligned class cannot shard: refused here, not by vLLM's workers
    from megatron_rz.launch.task_check import check_task

    # a data task's files, columns and prompt lengths fail here, before the warm start; task.epochs
    # becomes schedule.steps, passed on to torchrun's ranks as overrides (each derives it; rank 0 also
    # measures the prompts)
    args.overrides = [*args.overrides, *check_task(recipe, measure=os.environ.get("RANK", "0") == "0")]
    if recipe.warm_start.device == "cuda" and not recipe.model.pretrained:
        import torch

        if not torch.cuda.is_available():
            raise RecipeError("warm_start.device=cuda but this machine has no CUDA device: run the recipe on "
                              "a GPU machine or set warm_start.device=cpu")
    if recipe.mode == "fast" and recipe.rollout.where == "local" and family(recipe.model.arch).dsv4:
        import torch

        from vllm_bridge.engine import stock_deepseek_v4_cpu_refusal

        why = None if torch.cuda.is_available() else stock_deepseek_v4_cpu_refusal()
        if why:
            raise RecipeError(why)
    if recipe.mode == "fast" and recipe.rollout.where == "local":
        import torch

        from vllm_bridge.engine import cpu_onednn_isa_refusal

        # stock vLLM-CPU in bf16 under an ONEDNN_MAX_CPU_ISA cap without AMX, on an AMX CPU: its
        # worker would abort on the first forward; refused here, before the warm start
        why = None if torch.cuda.is_available() else cpu_onednn_isa_refusal(
            recipe.rollout.dtype or recipe.model.dtype, aligned=False)
        if why:
            raise RecipeError(why)
    # TE layers asked for (a fast learner; `rz bench step/async` run a fast leg whatever the mode):
    # refused here, before any warm start or engine, where Transformer Engine cannot run
    if recipe.runtime.te == "on" and (recipe.mode == "fast" or getattr(args, "cmd", None) == "bench") \
            and family(recipe.model.arch).learner is None:
        from megatron_rz.learner.te_spec import te_on_refusal, te_unavailable

        why = te_unavailable()
        if why:
            raise RecipeError(te_on_refusal(why))
    if recipe.rollout.weight_transport in ("nccl", "ipc") and recipe.rollout.where == "local":  # GPU only
        import torch

        from vllm_bridge.weights import refusal

        r = recipe.rollout
        why = refusal(r.weight_transport, where=r.where, max_lag=recipe.schedule.max_lag, mode=recipe.mode,
                      arch=recipe.model.arch, cuda=torch.cuda.is_available())
        if why:
            raise RecipeError(why)
    return recipe


def cmd_train(args) -> int:
    recipe = _load(args)
    from megatron_rz.loop.resume import resolve_load

    if recipe.model.pretrained:  # a wrong or mismatched base checkpoint fails here, before any engine
        from megatron_rz.learner.pretrained import check_pretrained

        check_pretrained(recipe)
    try:  # a wrong checkpoint path fails here, before the warm start and the engines ("latest" is
        # resolved by the trainer: it never fails, and verifying the checkpoints twice costs a re-read)
        if recipe.checkpoint.load != "latest":
            resolve_load(recipe.checkpoint.load, recipe.run_dir)
    except FileNotFoundError as e:
        raise RecipeError(str(e)) from None
    lock = _claim(recipe, args)
    try:
        extra = ["--overwrite"] if args.overwrite else []
        rc = _relaunch_under_torchrun(recipe, ["train", args.recipe, *args.overrides, *extra])
        if rc is not None:
            return rc
        from megatron_rz.loop.trainer import train

        summary = _train_or_stop(train, recipe)
    finally:
        if lock is not None:
            lock.release()
            os.environ.pop("RZ_RUN_DIR_CLAIMED", None)
    if summary:
        _print_summary(summary)
        print(json.dumps(summary))
    return 0


def cmd_check(args) -> int:
    recipe = _load(args)
    from megatron_rz.launch.rundir import writable_dir

    writable_dir(recipe.run_dir, "logging.run_dir")
    extra = ["--prompts", str(args.prompts), "--samples", str(args.samples)]
    for fault in args.inject_fault or []:
        extra += ["--inject-fault", fault]
    rc = _relaunch_under_torchrun(recipe, ["check", args.recipe, *args.overrides, *extra])
    if rc is not None:
        return rc
    from megatron_rz.tools.check import main_check

    return main_check(recipe, args.prompts, args.samples, args.inject_fault)


def cmd_bench(args) -> int:
    recipe = _load(args)
    from megatron_rz.launch.rundir import writable_dir

    writable_dir(recipe.run_dir, "logging.run_dir")
    from megatron_rz.tools.bench import main_bench

    return main_bench(recipe, args.what, args.rounds, args.lags)


def cmd_validate(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    import yaml

    print(yaml.safe_dump(recipe.model_dump(), sort_keys=False))
    print(f"ok: {args.recipe} is valid (learner world size {recipe.parallel.world_size})")
    return 0


def cmd_make_model(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RecipeError(f"--out {args.out}: {'is a file' if not out.is_dir() else 'is not empty'}; "
                          "name a new or empty directory (nothing there is replaced)")
    if recipe.model.pretrained:
        raise RecipeError(f"model.pretrained={recipe.model.pretrained!r}: make-model builds the tiny warm-start "
                          "model; drop model.pretrained (that checkpoint is the model)")
    from megatron_rz.launch.rundir import writable_dir
    from megatron_rz.learner.tiny_models import warm_start

    writable_dir(out, "--out")
    info = warm_start(recipe, Path(args.out), seed=recipe.schedule.seed)
    print(json.dumps({"out": args.out, **info}))
    return 0


def cmd_submit(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    from megatron_rz.launch.submit import submit

    submit(recipe, dry_run=args.dry_run, run_dir=args.run_dir)
    return 0


def cmd_plot(args) -> int:
    missing = [d for d in args.run_dir if not (Path(d) / "metrics.jsonl").is_file()]
    if missing:
        raise RecipeError(f"no metrics.jsonl in {missing}: pass run directories written by rz train")
    if args.labels and len(args.labels.split(",")) != len(args.run_dir):
        raise RecipeError(f"--labels {args.labels!r} has {len(args.labels.split(','))} labels for "
                          f"{len(args.run_dir)} run dirs; give one per run dir")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise RecipeError(f"--out {args.out} is a file; name a directory for the comparison plots")
    from megatron_rz.loop.metrics import check_metrics_file, plot_compare, plot_run

    for d in args.run_dir:  # a truncated or foreign file: named with its line before any plot is drawn
        check_metrics_file(Path(d) / "metrics.jsonl")
    from megatron_rz.launch.rundir import writable_dir

    if len(args.run_dir) == 1 and not args.out:
        writable_dir(Path(args.run_dir[0]) / "plots", "RUN_DIR (its plots/)")
        written = plot_run(Path(args.run_dir[0]))
    else:
        labels = args.labels.split(",") if args.labels else None
        writable_dir(args.out or "plots_compare", "--out")
        written = plot_compare([Path(d) for d in args.run_dir], Path(args.out or "plots_compare"), labels)
    for p in written:
        print(p)
    return 0


class UsageError(RecipeError):
    """A command line argparse refuses (one line, exit 2, like every bad input)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message and exits; we want one line
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _lags(text: str) -> tuple[int, ...]:
    try:
        lags = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers, e.g. 2,8") from None
    if not lags or min(lags) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each lag must be >= 1 (sync, lag 0, always runs)")
    return lags


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def main(argv: list[str] | None = None) -> int:
    """Every bad input (recipe file, key, value, flag, run directory) ends here as one line on
    stderr and exit code 2, before anything starts; --debug or RZ_DEBUG=1 adds the traceback (a switch
    of the command line, not of the run, so not a recipe field: a bad recipe is reported before one exists)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("RZ_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    from megatron_rz.rl.guards import RunStopped

    try:
        return _main(argv)
    except RunStopped as e:  # a run that stopped itself with the reason (e.g. non-finite updates)
        if debug:
            import traceback

            traceback.print_exc()
        print(f"rz: stopped: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        return 1
    except RecipeError as e:
        if debug:
            import traceback

            traceback.print_exc()
        print(f"rz: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    parser = _Parser(prog="rz", description="reinforce-zero: stable async RL on MoE models "
                     "(--debug or RZ_DEBUG=1: tracebacks for errors)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="run a recipe end to end")
    _recipe_args(p)
    p.add_argument("--overwrite", action="store_true",
                   help="delete the results of an earlier run in the run dir first (else rz train refuses)")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("check", help="per-token logprob parity vLLM vs learner (exit 1 if aligned is not bitwise)")
    _recipe_args(p)
    p.add_argument("--prompts", type=_positive, default=16)
    p.add_argument("--samples", type=_positive, default=4)
    p.add_argument("--inject-fault", metavar="SIDE:PARAM", default=None, action="append",
                   help="self-test of the localiser: scale one parameter (vllm:HF name or learner:Megatron "
                        "name) by 1+2^-8 on that side only; the report must name its layer and op "
                        "(repeatable: e.g. one fault per side)")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("bench", help="benchmarks: `rollout` (aligned vs fast rollout time), `step` (the whole RL "
                                     "step, aligned vs fast: rollout / learner / sync per update), `async` (async at "
                                     "--lags vs sync)")
    p.add_argument("what", choices=["rollout", "step", "async"])
    _recipe_args(p)
    p.add_argument("--rounds", type=_positive, default=5)
    p.add_argument("--lags", type=_lags, default=(2,), metavar="L[,L...]",
                   help="async: the max_lag values to run beside sync (max_lag 0), e.g. 2,8 (default 2)")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("validate", help="validate a recipe and print it resolved")
    _recipe_args(p)
    p.set_defaults(fn=cmd_validate)
    p = sub.add_parser("make-model", help="make the recipe's tiny checkpoint (tokenizer, init, warm start)")
    _recipe_args(p)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_make_model)
    p = sub.add_parser("submit", help="run a recipe as a SLURM job (its cluster section); --dry-run prints it")
    _recipe_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and memory plan, submit nothing")
    p.add_argument("--run-dir", default=None, help="continue this run dir (resumes its latest checkpoint)")
    p.set_defaults(fn=cmd_submit)
    p = sub.add_parser("plot", help="redraw a run's plots; with several run dirs, overlay them (--out DIR)")
    p.add_argument("run_dir", nargs="+")
    p.add_argument("--out", default=None, help="directory for the comparison plots")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run dir")
    p.set_defaults(fn=cmd_plot)
    # Overrides may follow flags (`rz submit r.yaml --dry-run a=b`): argparse stops filling a
    # positional list at the first flag, so collect the key=value words it left over.
    args, rest = parser.parse_known_args(argv)
    extra = [w for w in rest if "=" in w and not w.startswith("-")]
    if len(extra) != len(rest) or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(w for w in rest if w not in extra) or ' '.join(extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if args.cmd in ("train", "check", "bench"):
        # SIGTERM (scheduler, kill) -> SystemExit, so cleanup handlers run and no vLLM process leaks;
        # the trainers' loops turn it into checkpoint-then-exit (megatron_rz.launch.preemption).
        from megatron_rz.launch.preemption import install_sigterm_exit

        install_sigterm_exit()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
