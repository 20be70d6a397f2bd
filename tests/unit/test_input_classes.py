"""Classes of bad input, each closed over every field and command it applies to (the bad-input
contract of refusal.py: one `rz: error:` line naming the key and the fix, exit 2, no traceback,
nothing written):

- a non-finite number (nan, inf, -inf) in any float field of the recipe schema, or anywhere in a
  free-form section (task.kwargs), from the recipe file or a command-line override;
- a YAML mapping naming one key twice, at any depth, in a recipe file or an override value;
- a run directory (logging.run_dir, --out, --run-dir, cluster.log_dir / run_root) that cannot be
  created or written.

The float fields are found by walking the schema, so a field added later is covered without
editing this file."""

from __future__ import annotations

import math
import os
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from megatron_rz import cli
from megatron_rz.recipe import Recipe, load_recipe, load_yaml
from refusal import assert_refused

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_moe.yaml")
# every command that loads a recipe (argv before the recipe, argv after it)
COMMANDS = {
    "train": (["train"], []),
    "check": (["check"], []),
    "bench": (["bench", "rollout"], []),
    "validate": (["validate"], []),
    "make-model": (["make-model"], ["--out", "fresh"]),
    "submit": (["submit"], ["--dry-run"]),
}


def _holds_float(ann) -> bool:
    if ann is float:
        return True
    if typing.get_origin(ann) is typing.Literal:
        return False
    return any(_holds_float(a) for a in typing.get_args(ann))


def float_fields(model: type[BaseModel] = Recipe, prefix: str = "") -> list[tuple[str, typing.Any]]:
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += float_fields(ann, f"{prefix}{name}.")
        elif _holds_float(ann):
            out.append((prefix + name, ann))
    return out


FLOATS = float_fields()
NON_FINITE = [".nan", ".inf", "-.inf", "nan", "inf", "-inf", "NaN", "Infinity"]


def _override(key: str, ann, raw: str) -> str:
    if typing.get_origin(ann) is dict:  # rollout.logit_bias: {token id: bias}
        return f"{key}={{3: {raw}}}"
    if typing.get_origin(ann) is list:
        return f"{key}=[{raw}]"
    return f"{key}={raw}"


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("a file, not a directory\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RZ_DEBUG", raising=False)
    return tmp_path


# ------------------------------------------------------------------------------------ non-finite


def test_the_schema_walk_finds_the_float_fields():
    keys = {k for k, _ in FLOATS}
    assert len(keys) >= 35 and {"algo.lr", "rollout.temperature", "rollout.logit_bias", "task.epochs",
                                 "parallel.collective_timeout_s", "cluster.plan.overhead_gb"} <= keys


@pytest.mark.parametrize("key, ann", FLOATS, ids=[k for k, _ in FLOATS])
def test_every_float_field_refuses_every_non_finite_spelling(key, ann):
    for raw in NON_FINITE:
        with pytest.raises(ValueError) as e:
            load_recipe(TINY, [_override(key, ann, raw)])
        msg = str(e.value)
        assert key in msg and "finite" in msg and "\n" not in msg, (raw, msg)


@pytest.mark.parametrize("key", ["algo.lr", "rollout.temperature", "schedule.time_limit_s"])
def test_every_float_field_refuses_assignment_of_non_finite(key):
    recipe = load_recipe(TINY)
    section, field = key.split(".")
    for v in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValidationError):
            setattr(getattr(recipe, section), field, v)


@pytest.mark.parametrize("cmd", list(COMMANDS))
@pytest.mark.parametrize("over", ["algo.lr=nan", "rollout.temperature=.inf", "model.rope_theta=-inf",
                                  "schedule.steps=.inf", "task.kwargs={scale: [1, .nan]}"])
def test_every_command_refuses_non_finite_overrides(workdir, capsys, cmd, over):
    head, tail = COMMANDS[cmd]
    assert_refused(workdir, capsys, [*head, TINY, over, *tail], [over.split("=")[0], "finite"])


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_every_command_refuses_non_finite_in_the_recipe_file(workdir, capsys, cmd):
    (workdir / "r.yaml").write_text("algo:\n  lr: 1e-4\nwarm_start:\n  distractor_rate: .NaN\n")
    head, tail = COMMANDS[cmd]
    assert_refused(workdir, capsys, [*head, "r.yaml", *tail], ["warm_start.distractor_rate", "finite"])


def test_finite_values_and_nan_strings_in_free_form_fields_still_load():
    r = load_recipe(TINY, ["algo.lr=3e-5", "task.kwargs={label: nan, w: 1.5}"])
    assert r.algo.lr == 3e-5 and r.task.kwargs == {"label": "nan", "w": 1.5}


# ------------------------------------------------------------------------------- duplicate keys

DUPLICATES = {
    "top.yaml": ("algo:\n  lr: 1e-4\nrollout:\n  temperature: 1.0\nalgo:\n  lr: 2e-4\n", "'algo'", "line 5"),
    "section.yaml": ("rollout:\n  temperature: 1.0\n  max_new_tokens: 8\n  temperature: 0.7\n",
                     "'temperature'", "line 4"),
    "deep.yaml": ("task:\n  kwargs:\n    opts:\n      a: 1\n      b: 2\n      a: 3\n", "'a'", "line 6"),
    "flow.yaml": ("model: {hidden_size: 64, num_layers: 2, hidden_size: 32}\n", "'hidden_size'", "line 1"),
    "in_list.yaml": ("task:\n  kwargs:\n    rows:\n      - {x: 1}\n      - {y: 1, y: 2}\n", "'y'", "line 5"),
}


@pytest.mark.parametrize("name", list(DUPLICATES))
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_every_command_refuses_a_duplicated_key_at_any_depth(workdir, capsys, cmd, name):
    text, key, line = DUPLICATES[name]
    (workdir / name).write_text(text)
    head, tail = COMMANDS[cmd]
    assert_refused(workdir, capsys, [*head, name, *tail], ["duplicate key", key, line])


def test_a_duplicated_key_in_an_override_value_is_refused(workdir, capsys):
    assert_refused(workdir, capsys, ["train", TINY, "task.kwargs={a: 1, b: 2, a: 3}"],
                   ["task.kwargs", "duplicate key 'a'"])


def test_a_merge_key_overridden_is_no_duplicate():
    """`<<: *anchor` then an explicit key is YAML's override, not a repetition."""
    assert load_yaml("b: &b {lr: 1, k: 2}\nalgo:\n  <<: *b\n  lr: 3\n")["algo"] == {"lr": 3, "k": 2}
    with pytest.raises(Exception, match="duplicate key 'lr'"):
        load_yaml("algo:\n  lr: 1\n  k: 2\n  lr: 3\n")


def test_the_shipped_recipes_have_no_duplicated_keys():
    for p in sorted((ROOT / "recipes").glob("*.yaml")):
        assert isinstance(load_yaml(p.read_text()), dict), p


# ------------------------------------------------------------------------------ run directories


def _unwritable_root() -> str | None:
    """An existing directory this process cannot write (/sys is mounted read-only in containers)."""
    try:
        (Path("/sys") / f".rz-probe-{os.getpid()}").write_bytes(b"")
    except OSError:
        return "/sys"
    return None


RO = _unwritable_root()
BAD_DIRS = {  # path -> fragment of the reason
    "afile/run": "afile is a file",
    "afile": "is a file",
    "new/" + "x" * 300: "cannot be created",
}
if RO:
    BAD_DIRS[f"{RO}/rz-run"] = "cannot be created"
    BAD_DIRS[RO] = "cannot be written"
# (argv builder, the key named)
DIR_ARGS = {
    "train": (lambda d: ["train", TINY, f"logging.run_dir={d}"], "logging.run_dir"),
    "train-resume": (lambda d: ["train", TINY, f"logging.run_dir={d}", "checkpoint.load=latest"], "logging.run_dir"),
    "check": (lambda d: ["check", TINY, f"logging.run_dir={d}"], "logging.run_dir"),
    "bench": (lambda d: ["bench", "async", TINY, f"logging.run_dir={d}"], "logging.run_dir"),
    "make-model": (lambda d: ["make-model", TINY, "--out", d], "--out"),
    "submit-run-dir": (lambda d: ["submit", TINY, "--run-dir", d], "--run-dir"),
    "submit-log-dir": (lambda d: ["submit", TINY, f"cluster.log_dir={d}"], "cluster.log_dir"),
    "submit-run-root": (lambda d: ["submit", TINY, f"cluster.run_root={d}"], "cluster.run_root"),
}


@pytest.mark.parametrize("path", list(BAD_DIRS), ids=lambda p: p[:20])
@pytest.mark.parametrize("cmd", list(DIR_ARGS))
def test_a_run_dir_that_cannot_be_made_or_written_is_one_line(workdir, capsys, cmd, path):
    if cmd == "make-model" and path == RO:
        pytest.skip("make-model refuses a non-empty --out first (its own line)")
    build, key = DIR_ARGS[cmd]
    assert_refused(workdir, capsys, build(path), [key, BAD_DIRS[path]])


def test_plot_out_that_cannot_be_made_is_one_line(workdir, capsys):
    for d in ("a", "b"):
        (workdir / d).mkdir()
        (workdir / d / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    assert_refused(workdir, capsys, ["plot", "a", "b", "--out", "afile/cmp"], ["--out", "afile is a file"])


def test_a_failed_later_dir_removes_the_dirs_made_for_the_earlier(workdir):
    from megatron_rz.launch.rundir import RunDirError, writable_dirs

    with pytest.raises(RunDirError, match="--b"):
        writable_dirs([(workdir / "made" / "deep", "--a"), (workdir / "afile" / "x", "--b")])
    assert not (workdir / "made").exists()
    writable_dirs([(workdir / "ok" / "deep", "--a")])
    assert (workdir / "ok" / "deep").is_dir() and not any((workdir / "ok" / "deep").iterdir())
