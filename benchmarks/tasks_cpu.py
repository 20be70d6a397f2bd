"""Real-task training on the CPU: held-out accuracy before -> after a short `rz train` on

* ``math``: a jsonl math file (recipes/tiny_math_jsonl.yaml): "Compute 47+38." -> ``\\boxed{85}``,
  the math_verify reward, a chat template read from the base checkpoint's tokenizer, greedy / avg@4 /
  pass@1 / pass@4 on a held-out jsonl split. The base model is the tiny warm start (`rz make-model`)
  on an SFT copy of the training rows in which 60% of the carrying sums are written without the
  carry (47+38 -> \\boxed{75}): a base model that prefers a systematic mistake, which only the
  reward can correct (as recipes/tiny_moe.yaml's distractor_rate does for the toy task). RL trains
  on the clean rows.
* ``gym``: reasoning-gym chain_sum (recipes/tiny_gym.yaml) with its own scorer, 200 held-out
  entries of another seed; variants of the recipe (warm start with a planted mistake, learning rates).

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/tasks_cpu.py --root RUNS_DIR
        [--only math gym_lr2e-4 ...] [--report-only] [--out benchmarks/results/tasks_cpu]

Every run goes into its own new directory RUNS_DIR/<name> (an existing one is refused, never
overwritten); the data files are written under RUNS_DIR/data (seeded: the same files every time).
--report-only rereads every known run found under RUNS_DIR and writes report.json / report.md and the
runs' held-out plots to --out. An opt-in benchmark, not a test (minutes per run on one CPU core).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH_RECIPE = "recipes/tiny_math_jsonl.yaml"
GYM_RECIPE = "recipes/tiny_gym.yaml"
# the chat template baked into the math base model's tokenizer (the run reads it: chat_template=auto)
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CPU_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
           "ONEDNN_MAX_CPU_ISA": "AVX2", "WANDB_MODE": "offline", "OMP_WAIT_POLICY": "PASSIVE"}

# name -> (recipe, base-model kind, overrides). "math" runs make their base model first (make-model on
# the SFT file with the planted mistake); the gym runs warm start inside rz train.
EXPERIMENTS: dict[str, tuple[str, str, list[str]]] = {
    "math": (MATH_RECIPE, "math_sft", []),
    # control: the base model warm-started on the clean training rows (no planted mistake)
    "math_clean_base": (MATH_RECIPE, "math_clean", []),
    "gym_distract_lr2e-4": (GYM_RECIPE, "own", ["warm_start.distractor_rate=0.6"]),
    "gym_distract_lr5e-4": (GYM_RECIPE, "from:gym_distract_lr2e-4", ["warm_start.distractor_rate=0.6", "algo.lr=5e-4"]),
    "gym_distract_lr1e-4": (GYM_RECIPE, "from:gym_distract_lr2e-4", ["warm_start.distractor_rate=0.6", "algo.lr=1e-4"]),
    "gym_nodistract_lr2e-4": (GYM_RECIPE, "own", ["warm_start.distractor_rate=0"]),
    "gym_distract_lr2e-4_100u": (GYM_RECIPE, "from:gym_distract_lr2e-4", ["warm_start.distractor_rate=0.6",
                                                                          "schedule.steps=100"]),
    "gym_distract_lr2e-4_seed1": (GYM_RECIPE, "own", ["warm_start.distractor_rate=0.6", "schedule.seed=1"]),
    "gym_nodistract_lr2e-4_seed1": (GYM_RECIPE, "own", ["warm_start.distractor_rate=0", "schedule.seed=1"]),
}
# "from:NAME": the run starts from a copy of run NAME's base_model/ (same warm start: rz train reuses
# it when its hash matches the recipe's, so only RL settings differ between the two runs)


# ------------------------------------------------------------------------------------------ the data

def carryless(a: int, b: int) -> int:
    """a + b added column by column without carrying (47+38 -> 75)."""
    w = max(len(str(a)), len(str(b)))
    x, y = str(a).zfill(w), str(b).zfill(w)
    return int("".join(str((int(p) + int(q)) % 10) for p, q in zip(x, y)))


def math_data(data: Path, n_train: int = 3000, n_heldout: int = 200, seed: int = 0, rate: float = 0.6) -> dict:
    """train.jsonl / heldout.jsonl (disjoint two-digit sums) and sft.jsonl (the training rows, 60% of
    the carrying ones answered without the carry). Seeded: the same files every call."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    held, train = pairs[:n_heldout], pairs[n_heldout:n_heldout + n_train]
    row = lambda a, b, c: {"problem": f"Compute {a}+{b}.", "answer": f"\\boxed{{{c}}}"}  # noqa: E731
    data.mkdir(parents=True, exist_ok=True)
    files = {"train": [row(a, b, a + b) for a, b in train], "heldout": [row(a, b, a + b) for a, b in held]}
    sft, planted = [], 0
    for a, b in train:
        wrong = carryless(a, b)
        if wrong != a + b and rng.random() < rate:
            sft.append(row(a, b, wrong))
            planted += 1
        else:
            sft.append(row(a, b, a + b))
    files["sft"] = sft
    for name, rows in files.items():
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    carrying = sum(carryless(a, b) != a + b for a, b in train)
    return {"train_rows": len(train), "heldout_rows": len(held), "carrying_train_rows": carrying,
            "sft_rows_with_planted_mistake": planted}


# ------------------------------------------------------------------------------------------ running

def sh(cmd: list[str], log: Path) -> float:
    print("  $ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        rc = subprocess.call(["taskset", "-c", os.environ.get("RZ_CPU", "1"), *cmd], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT, env={**os.environ, **CPU_ENV})
    if rc != 0:
        raise SystemExit(f"exit {rc}: {' '.join(cmd)}; log: {log}")
    return time.perf_counter() - t0


def math_base(root: Path, data: Path, log: Path, sft: str = "sft") -> tuple[Path, list[str], float]:
    """The math base model: rz make-model on sft.jsonl (prompts through TEMPLATE), then TEMPLATE set
    on its tokenizer, so the run's chat_template=auto finds it there. sft="train": on the clean rows."""
    base = root / ("math_base_model" if sft == "sft" else f"math_base_model_{sft}")
    if base.exists():
        raise SystemExit(f"{base} exists: give a new --root (runs are never overwritten)")
    cmd = [".venv/bin/rz", "make-model", MATH_RECIPE, "--out", str(base), f"task.path={data / (sft + '.jsonl')}",
           f"task.eval_sets.heldout={data / 'heldout.jsonl'}", f"task.chat_template={TEMPLATE}"]
    secs = sh(cmd, log)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(base)
    return base, cmd, secs


def run_one(root: Path, name: str, data: Path) -> dict:
    recipe, kind, overrides = EXPERIMENTS[name]
    run = root / name
    if run.exists():
        raise SystemExit(f"{run} exists: runs are never overwritten; give a new --root or another name")
    log = root / f"{name}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {recipe} {' '.join(overrides)}", flush=True)
    cmds, secs = [], 0.0
    extra = []
    if kind in ("math_sft", "math_clean"):
        base, cmd, s = math_base(root, data, log, "sft" if kind == "math_sft" else "train")
        cmds.append(cmd)
        secs += s
        extra = [f"model.pretrained={base}", f"task.path={data / 'train.jsonl'}",
                 f"task.eval_sets.heldout={data / 'heldout.jsonl'}"]
    if kind.startswith("from:"):
        src = root / kind[5:] / "base_model"
        if not src.is_dir():
            raise SystemExit(f"{name} starts from {src}: run {kind[5:]} first")
        run.mkdir(parents=True)
        shutil.copytree(src, run / "base_model")
        cmds.append(["cp", "-r", str(src), str(run / "base_model")])
    cmd = [".venv/bin/rz", "train", recipe, f"logging.run_dir={run}", "logging.progress=false", *extra, *overrides]
    s = sh(cmd, log)
    cmds.append(cmd)
    secs += s
    info = {"name": name, "recipe": recipe, "overrides": overrides, "commands": [shlex.join(c) for c in cmds],
            "seconds": round(secs, 1), "seconds_rz_train": round(s, 1)}
    (run / "tasks_cpu_run.json").write_text(json.dumps(info, indent=2) + "\n")
    r = result(run)
    print(f"  {name}: {fmt(r)} ({secs:.0f} s)", flush=True)
    return r


# ------------------------------------------------------------------------------------------ the report

def result(run: Path) -> dict:
    info = json.loads((run / "tasks_cpu_run.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if "eval_reward" in r]
    updates = max((r["step"] for r in rows if "frac_bitwise" in r), default=0)
    sets = sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.count("/") == 2})
    per = {}
    for s in sets:
        keys = sorted({k.split("/")[2] for r in evals for k in r if k.startswith(f"eval/{s}/")})
        per[s] = {m: {"before": evals[0].get(f"eval/{s}/{m}"), "after": evals[-1].get(f"eval/{s}/{m}"),
                      "curve": [[r["step"], r.get(f"eval/{s}/{m}")] for r in evals]} for m in keys}
    bitwise = [r["frac_bitwise"] for r in rows if "frac_bitwise" in r]
    return {**info, "run_dir": str(run), "updates": updates, "eval": per,
            "frac_bitwise_min": min(bitwise) if bitwise else None,
            "reward_errors": sum(r.get("reward_errors", 0) for r in rows)}


def fmt(r: dict) -> str:
    out = []
    for s, ms in r["eval"].items():
        out.append(s + ": " + ", ".join(f"{m} {v['before']:.3f} -> {v['after']:.3f}" for m, v in ms.items()
                                        if m in ("greedy", "pass@1", "avg@4", "pass@4") and v["before"] is not None))
    return "; ".join(out) + f" after {r['updates']} updates"


def report_owner(out: Path) -> str | None:
    """The --root whose runs the report in ``out`` describes (None: no report there)."""
    f = out / "report.json"
    if not f.exists():
        return None
    d = json.loads(f.read_text())
    runs = d.get("runs") or [{}]
    return d.get("root") or str(Path(runs[0].get("run_dir", "?")).parent)


def report(root: Path, out: Path, extra: dict) -> None:
    results = [result(root / n) for n in EXPERIMENTS if (root / n / "tasks_cpu_run.json").exists()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({**extra, "root": str(root), "runs": results}, indent=2) + "\n")
    lines = ["# Real tasks on the CPU (benchmarks/tasks_cpu.py)", "",
             "Held-out figures at the first and the last evaluation of each run (eval/<set>/<metric> in "
             "metrics.jsonl). One CPU core (taskset -c 1), OMP_NUM_THREADS=1, make demo's ISA pinning.", ""]
    if extra.get("math_data"):
        lines += [f"Math data: {json.dumps(extra['math_data'])}", ""]
    lines += ["| run | overrides | updates | s | greedy | avg@4 | pass@1 | pass@4 |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for s, ms in r["eval"].items():
            cell = lambda m: (f"{ms[m]['before']:.3f} -> {ms[m]['after']:.3f}" if m in ms and ms[m]["before"]  # noqa: E731
                              is not None else "")
            lines.append(f"| {r['name']} ({s}) | {' '.join(r['overrides']) or '-'} | {r['updates']} | {r['seconds']:.0f} | "
                         f"{cell('greedy')} | {cell('avg@4')} | {cell('pass@1')} | {cell('pass@4')} |")
    lines += ["", "s: wall seconds of the run's commands (the math run's include `rz make-model`, the warm start; "
              "`rz train` alone in report.json, seconds_rz_train). Commands (from the repository root, each "
              "under `taskset -c 1` and the environment above):", ""]
    for r in results:
        lines += [f"- {r['name']}:", "", "```"] + r["commands"] + ["```", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    for r in results:
        for png in sorted((Path(r["run_dir"]) / "plots").glob("eval_*.png")):
            shutil.copy(png, out / f"{r['name']}_{png.name}")
    print(f"report: {out / 'report.md'}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, type=Path, help="where the run directories are made")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tasks_cpu")
    ap.add_argument("--only", nargs="*", choices=list(EXPERIMENTS), help="these runs (default: all)")
    ap.add_argument("--report-only", action="store_true", help="no runs: the report of the runs under --root")
    a = ap.parse_args(argv)
    a.root = a.root.resolve()
    owner = report_owner(a.out)
    if owner is not None and owner != str(a.root):
        raise SystemExit(f"--out {a.out} holds the report of the runs under {owner}: give a new --out "
                         "(another experiment's report is never overwritten)")
    a.root.mkdir(parents=True, exist_ok=True)
    data = a.root / "data"
    md = math_data(data)
    print(f"math data under {data}: {md}", flush=True)
    if not a.report_only:
        t0 = time.perf_counter()
        for name in a.only or list(EXPERIMENTS):
            run_one(a.root, name, data)
        print(f"all runs: {time.perf_counter() - t0:.0f} s", flush=True)
    report(a.root, a.out, {"math_data": md})


if __name__ == "__main__":
    main()
