"""tests/gpu/h200_session.sh packs $OUT when a call would bring back more files than the GPU machine
returns (8): each stage folder becomes one archive, every file inside it intact; 8 files or fewer
are left as they are."""

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "h200_session.sh"


def _run(out: Path, **env):
    return subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "OUT": str(out), **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _fill(out: Path, layout: dict[str, int]) -> dict[str, bytes]:
    files = {}
    for folder, n in layout.items():
        for i in range(n):
            p = out / folder / f"f{i}.json" if folder else out / f"f{i}.json"
            p.parent.mkdir(parents=True, exist_ok=True)
            data = os.urandom(64 + i)
            p.write_bytes(data)
            files[str(p.relative_to(out))] = data
    return files


def _unpacked(out: Path) -> dict[str, bytes]:
    got = {}
    for p in out.rglob("*"):
        if p.is_file() and p.suffix == ".tgz":
            with tarfile.open(p) as t:
                for m in t.getmembers():
                    if m.isfile():
                        got[os.path.normpath(m.name)] = t.extractfile(m).read()
        elif p.is_file():
            got[str(p.relative_to(out))] = p.read_bytes()
    return got


def test_stage_folders_are_packed_past_eight_files(tmp_path):
    out = tmp_path / "out"
    files = _fill(out, {"check": 6, "bench": 5, "": 1})
    r = _run(out)
    assert r.returncode == 0, r.stderr
    left = sorted(p.name for p in out.iterdir())
    assert left == ["bench.tgz", "check.tgz", "f0.json"], left
    assert _unpacked(out) == files


def test_everything_in_one_archive_when_the_folders_are_still_too_many(tmp_path):
    out = tmp_path / "out"
    files = _fill(out, {**{f"s{i}": 1 for i in range(6)}, "": 5})
    r = _run(out)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["out.tgz"]
    assert _unpacked(out) == files


def test_eight_files_or_pack_out_off_are_left_alone(tmp_path):
    out = tmp_path / "out"
    files = _fill(out, {"check": 4, "": 4})
    assert _run(out).returncode == 0
    assert _unpacked(out) == files and not list(out.glob("*.tgz"))
    out2 = tmp_path / "out2"
    files2 = _fill(out2, {"check": 9})
    assert _run(out2, PACK_OUT="0").returncode == 0
    assert _unpacked(out2) == files2 and not list(out2.glob("*.tgz"))


def test_a_failed_stage_sets_the_exit_status_and_the_outputs_are_still_packed(tmp_path):
    out = tmp_path / "out"
    files = _fill(out, {"check": 6, "bench": 5})
    r = subprocess.run(["bash", str(SCRIPT), "no_such_stage"], env={**os.environ, "OUT": str(out)}, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    # (the failed stage's own folder, empty, travels as an archive too)
    assert sorted(p.name for p in out.iterdir()) == ["bench.tgz", "check.tgz", "no_such_stage.tgz"]
    assert {k: v for k, v in _unpacked(out).items() if k in files} == files
