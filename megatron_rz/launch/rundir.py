"""Run directories: what made a run, one live run per directory, nothing clobbered.

- `run.json` records what made the run: the resolved recipe, its hash, the hash of the parts that
  shape the base model (`base_model_hash`; both hashes: megatron_rz.fingerprint) and every start
  (time, host, pid, checkpoint.load).
- `claim_run_dir` (rz train, before anything starts) refuses a directory that holds another run's
  results (metrics.jsonl, checkpoints/, summary.json, hf_final/, ...) unless the run resumes
  (`checkpoint.load=latest` or a checkpoint dir) or `--overwrite` is given; only --overwrite deletes,
  and only those results (base models are kept: they are reused by hash).
- `rz.lock` holds the live run's pid, host, process start time and SLURM job id. A second live run
  in the same directory is refused naming the holder; the lock of a dead process (SIGKILL, OOM) is
  taken over, as is one left by an earlier allocation of the same (requeued) SLURM job.
- `base_model_dir` picks the starting checkpoint of a tiny-model run: `base_model/` only when its
  recorded hash (warm_start.json `base_hash`, written by tiny_models.warm_start) equals the recipe's;
  otherwise `base_model-<hash>/`, made (atomically: built aside, then renamed) when absent. So a run
  whose model sizes, task, warm start or seed changed never starts from another run's base model.

Imports neither Megatron nor vLLM: the CLI calls it before any engine starts.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import time
from pathlib import Path

from megatron_rz.fingerprint import NOT_RESULTS, base_model_hash, recipe_hash
from megatron_rz.recipe import Recipe, RecipeError

RECORD = "run.json"
LOCK = "rz.lock"
# What a run writes into its directory (besides base models, which are shared by hash).
# (rz check's check.json and the base models are not a training run's results.)
RESULTS = ("metrics.jsonl", "summary.json", "checkpoints", "hf_final", "plots", "wandb", "PREEMPTED",
           "recipe.yaml", RECORD)


class RunDirError(RecipeError):
    """A run directory that cannot be used as asked (exit code 2, one line, like a bad recipe)."""


def writable_dir(path: str | Path, key: str) -> Path:
    """Make directory ``path`` (and its parents) and prove a file can be written in it, before a
    command starts anything; else one RunDirError naming ``key`` (e.g. logging.run_dir, --out), the
    reason and the fix. Directories made here are removed again when the write fails."""
    writable_dirs([(path, key)])
    return Path(path)


def writable_dirs(dirs: list[tuple[str | Path, str]]) -> None:
    """writable_dir for each (path, key); when one fails, the directories made for the others go too."""
    made: list[Path] = []
    try:
        for path, key in dirs:
            _writable(Path(path), key, made)
    except RunDirError:
        for d in reversed(made):  # deepest first
            try:
                d.rmdir()
            except OSError:
                pass
        raise


def _writable(p: Path, key: str, made: list[Path]) -> None:
    fix = f"name a directory this user can create and write ({key}=DIR)"
    if p.exists() and not p.is_dir():
        raise RunDirError(f"{key}={p}: {p} is a file, not a directory; {fix}")
    missing = []
    q = p
    while not q.exists() and q != q.parent:
        missing.append(q)
        q = q.parent
    if q.exists() and not q.is_dir():
        raise RunDirError(f"{key}={p}: {q} is a file, so no directory can be made under it; {fix}")
    probe = p / f".rz-write-test-{os.getpid()}"
    try:
        for d in reversed(missing):  # shallowest first, each recorded once made
            d.mkdir(exist_ok=True)
            made.append(d)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        what = "created" if missing else "written"
        raise RunDirError(f"{key}={p}: the directory cannot be {what} ({e.strerror or type(e).__name__}"
                          f"{f': {e.filename}' if e.filename else ''}); {fix}") from None


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of update ``step`` lives in a run directory."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def recorded_base_hash(base: Path) -> str | None:
    try:
        return json.loads((Path(base) / "warm_start.json").read_text()).get("base_hash")
    except (OSError, ValueError, AttributeError):
        return None


def base_model_dir(recipe: Recipe, run_dir: Path) -> tuple[Path, bool]:
    """(the base model dir for this recipe, whether it still has to be made)."""
    h = base_model_hash(recipe, recipe.schedule.seed)
    default = Path(run_dir) / "base_model"
    if not default.exists():
        return default, True
    if recorded_base_hash(default) == h:
        return default, False
    other = Path(run_dir) / f"base_model-{h}"
    return other, recorded_base_hash(other) != h


def build_base_model(recipe: Recipe, target: Path, progress: bool = True) -> dict:
    """Warm-start into a side directory, then rename it into place: a killed build never leaves a
    directory that looks like a base model (a stale partial one is replaced)."""
    from megatron_rz.learner.tiny_models import warm_start

    target = Path(target)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    info = warm_start(recipe, tmp, seed=recipe.schedule.seed, progress=progress)
    if target.exists():  # a partial or unrecorded dir of the same name (never a matching base model)
        shutil.rmtree(target)
    os.rename(tmp, target)
    return info


# ------------------------------------------------------------------------------ results and lock


def results_in(run_dir: Path) -> list[str]:
    """The results of a run found in run_dir, described (empty: nothing to protect)."""
    run_dir = Path(run_dir)
    found = []
    for name in RESULTS:
        p = run_dir / name
        if not p.exists() or name in ("recipe.yaml", RECORD):
            continue
        if name == "metrics.jsonl":
            rows = sum(1 for line in p.read_text(errors="replace").splitlines() if line.strip())
            found.append(f"metrics.jsonl ({rows} rows)")
        elif name == "checkpoints":
            steps = sorted(c.name for c in p.glob("step_*"))
            if steps:
                found.append(f"checkpoints/ ({len(steps)}, newest {steps[-1]})")
        else:
            found.append(name + ("/" if p.is_dir() else ""))
    return found


def _proc_start(pid: int) -> str | None:
    try:  # field 22 of /proc/PID/stat: start time in clock ticks since boot (guards against pid reuse)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start is None or _proc_start(pid) in (None, start)


class RunLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.pid = os.getpid()

    def release(self) -> None:
        try:
            if json.loads(self.path.read_text()).get("pid") == self.pid:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _lock_holder(path: Path) -> str | None:
    """Who holds the lock at path (a description), or None when it is free or stale."""
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        # unreadable: being written right now (a run starting at the same moment), or left by a
        # process killed mid-write; only the latter is stale
        try:
            young = time.time() - path.stat().st_mtime < 10
        except OSError:
            return None
        return f"a run starting now (unfinished lock file {path})" if young else None
    host, pid, job = info.get("host"), int(info.get("pid", -1)), info.get("slurm_job")
    who = f"pid {pid} on {host} (started {info.get('started', '?')}{', SLURM job ' + str(job) if job else ''})"
    if job and job == os.environ.get("SLURM_JOB_ID"):
        return None  # an earlier allocation of this requeued job
    if host == socket.gethostname():
        return who if _alive(pid, info.get("start_ticks")) else None
    return who  # another machine: cannot tell whether it lives


def _take_lock(run_dir: Path) -> RunLock:
    path = Path(run_dir) / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _proc_start(os.getpid()),
          "slurm_job": os.environ.get("SLURM_JOB_ID"), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _lock_holder(path)
            if holder is not None:
                raise RunDirError(
                    f"run dir {run_dir} is in use by another live run: {holder}; wait for it, start this one "
                    f"with another name=..., or delete {path} if that process is gone") from None
            print(f"[rz] taking over the stale lock {path} ({path.read_text(errors='replace').strip()})", flush=True)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        lock = RunLock(path)
        atexit.register(lock.release)
        return lock
    raise RunDirError(f"could not take the lock {path}: another run keeps taking it")


def claim_run_dir(recipe: Recipe, overwrite: bool = False, argv: list[str] | None = None) -> RunLock:
    """Before `rz train` starts anything: refuse a directory holding another run's results (unless
    resuming or --overwrite), take the lock, record what makes this run. Returns the lock."""
    run_dir = recipe.run_dir
    resume = recipe.checkpoint.load is not None
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} is a file; set name=... or logging.run_dir=... to a directory")
    lock_path = run_dir / LOCK
    holder = _lock_holder(lock_path) if lock_path.exists() else None
    if holder is not None:
        raise RunDirError(f"run dir {run_dir} is in use by another live run: {holder}; wait for it, start this "
                          f"one with another name=..., or delete {lock_path} if that process is gone")
    found = results_in(run_dir) if run_dir.is_dir() else []
    record = _read_record(run_dir)
    if found and not resume and not overwrite:
        other = ("name=OTHER (or logging.run_dir=DIR)" if "{name}" in recipe.logging.run_dir
                 else "logging.run_dir=OTHER_DIR")
        made = f" of run {record['recipe'].get('name')!r} started {record['starts'][0]['time']}" if record else ""
        raise RunDirError(
            f"run dir {run_dir} holds the results{made}: {', '.join(found)}. Nothing was changed. Resume it with "
            f"checkpoint.load=latest, start a new run with {other}, or pass --overwrite to delete those "
            f"results (base models are kept)")
    writable_dir(run_dir, "logging.run_dir")
    lock = _take_lock(run_dir)
    try:
        if found and overwrite and not resume:
            for name in RESULTS:
                p = run_dir / name
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
            print(f"[rz] --overwrite: deleted the earlier results in {run_dir}: {', '.join(found)}", flush=True)
            record = None
        if resume and record and record.get("recipe_hash") != recipe_hash(recipe):
            diff = _differences(record.get("recipe", {}), recipe.model_dump())
            print(f"[rz] warning: resuming {run_dir} with a recipe that differs from the one that started it: "
                  f"{', '.join(diff) or '(schema changed)'}", flush=True)
        _write_record(run_dir, recipe, record, argv)
    except BaseException:
        lock.release()
        raise
    return lock


def _read_record(run_dir: Path) -> dict | None:
    try:
        rec = json.loads((Path(run_dir) / RECORD).read_text())
        return rec if isinstance(rec, dict) and rec.get("starts") else None
    except (OSError, ValueError):
        return None


def _write_record(run_dir: Path, recipe: Recipe, record: dict | None, argv: list[str] | None) -> None:
    start = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(), "pid": os.getpid(),
             "checkpoint_load": recipe.checkpoint.load, "argv": argv}
    rec = {
        "recipe": recipe.model_dump(),
        "recipe_hash": recipe_hash(recipe),
        "base_model_hash": None if recipe.model.pretrained else base_model_hash(recipe, recipe.schedule.seed),
        "starts": (record or {}).get("starts", []) + [start],
    }
    tmp = Path(run_dir) / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(rec, indent=1, default=str))
    os.replace(tmp, Path(run_dir) / RECORD)


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        key = f"{prefix}{k}"
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, key + ".")
        elif a != b and not any(key == f"{s}.{f}" for s, fs in NOT_RESULTS.items() for f in fs):
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def prepare_base_model(recipe: Recipe, run_dir: Path) -> Path:
    """The starting checkpoint: model.pretrained (checked against the recipe), else the tiny model
    (tokenizer + random init + SFT warm start) made for this recipe's base-model hash: base_model/
    when it was made from the same settings, else base_model-<hash>/ (base_model_dir). Collective:
    rank 0 builds it, every rank waits."""
    import torch.distributed as dist

    from megatron_rz.learner.ranks import rank

    if recipe.model.pretrained:
        from megatron_rz.learner.pretrained import check_pretrained

        return check_pretrained(recipe)
    base, missing = base_model_dir(recipe, run_dir)
    if base.name != "base_model" and rank() == 0:
        print(f"[rz] {run_dir / 'base_model'} was made from other model/task/warm-start settings: "
              f"{'making' if missing else 'using'} {base}", flush=True)
    if missing:
        if rank() == 0:
            info = build_base_model(recipe, base, progress=recipe.logging.progress)
            print(f"[rz] warm start done: {json.dumps(info)}", flush=True)
        if dist.is_initialized():
            dist.barrier()
    return base
