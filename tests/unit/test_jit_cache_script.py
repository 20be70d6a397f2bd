"""tests/gpu/jit_cache.sh: the engines' JIT caches saved on one machine and unpacked on another
(run here with a temporary HOME each)."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "gpu" / "jit_cache.sh"


def _run(home: Path, *args: str, piece_mb: str = "1") -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "PIECE_MB": piece_mb}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fill(home: Path) -> None:
    (home / ".triton/cache/abc").mkdir(parents=True)
    (home / ".triton/cache/abc/k.cubin").write_bytes(os.urandom(3 * 1024 * 1024 // 2))  # > one 1 MiB piece
    (home / ".triton/cache/abc/k.json").write_text('{"name": "k"}')
    (home / ".cache/vllm/torch_compile_cache/29f2/rank_0_0").mkdir(parents=True)
    (home / ".cache/vllm/torch_compile_cache/29f2/rank_0_0/graph.py").write_text("x = 1\n")
    (home / "unrelated.txt").write_text("not a cache")


def test_save_then_load_gives_the_same_files(tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    _fill(a)
    b.mkdir()
    r = _run(a, "save", str(out))
    assert r.returncode == 0, r.stderr
    assert len(list(out.glob("jit_cache.tgz.part*"))) == 2  # 1.5 MiB of random bytes in 1 MiB pieces
    r = _run(b, "load", str(out))
    assert r.returncode == 0, r.stderr
    want = {k: v for k, v in _tree(a).items() if k != "unrelated.txt"}
    assert _tree(b) == want


def test_load_keeps_files_already_there(tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    _fill(a)
    assert _run(a, "save", str(out)).returncode == 0
    mine = b / ".triton/cache/abc/k.json"
    mine.parent.mkdir(parents=True)
    mine.write_text("the machine's own entry")
    assert _run(b, "load", str(out)).returncode == 0
    assert mine.read_text() == "the machine's own entry"
    assert (b / ".cache/vllm/torch_compile_cache/29f2/rank_0_0/graph.py").read_text() == "x = 1\n"


@pytest.mark.parametrize("fault", ["flip", "drop"])
def test_a_damaged_copy_is_refused_and_nothing_unpacked(tmp_path, fault):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    _fill(a)
    b.mkdir()
    assert _run(a, "save", str(out)).returncode == 0
    pieces = sorted(out.glob("jit_cache.tgz.part*"))
    if fault == "flip":
        data = bytearray(pieces[0].read_bytes())
        data[len(data) // 2] ^= 0x01
        pieces[0].write_bytes(bytes(data))
    else:
        pieces[-1].unlink()
    r = _run(b, "load", str(out))
    assert r.returncode == 1
    assert "fails its checksum" in r.stderr
    assert _tree(b) == {}


def test_nothing_to_save_and_bad_arguments(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run(empty, "save", str(tmp_path / "out"))
    assert r.returncode == 1 and "nothing saved" in r.stderr
    assert _run(empty, "load", str(tmp_path / "missing")).returncode == 1
    assert _run(empty, "frobnicate", str(tmp_path)).returncode == 2
    assert _run(empty).returncode == 2


def test_save_never_overwrites_an_earlier_save(tmp_path):
    a, out = tmp_path / "a", tmp_path / "out"
    _fill(a)
    assert _run(a, "save", str(out)).returncode == 0
    before = _tree(out)
    r = _run(a, "save", str(out))
    assert r.returncode == 1 and "already holds a saved cache" in r.stderr
    assert _tree(out) == before
