"""tests/gpu/split_payload.sh: the staged vLLM payload re-cut into smaller parts (what a GPU call can
carry beside the tree) comes back byte for byte, with NPARTS and the checksum beside the last part;
damaged parts, an existing destination and a bad size are refused."""

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "split_payload.sh"


def _stage(tmp: Path, payload: bytes, cuts=(1_200_000, 2_100_000)) -> Path:
    src = tmp / "stage"
    pieces = [payload[:cuts[0]], payload[cuts[0]:cuts[1]], payload[cuts[1]:]]
    for i, piece in enumerate(pieces):
        d = src / f"c{i + 1}"
        d.mkdir(parents=True)
        (d / f"payload.tar.{i:02d}").write_bytes(piece)
    (src / "c3" / "PAYLOAD_SHA256").write_text(f"{hashlib.sha256(payload).hexdigest()}  payload.tar\n")
    (src / "c3" / "NPARTS").write_text("3\n")
    (src / "bin").mkdir()
    return src


def _run(*args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_parts_of_the_given_size_rebuild_the_payload(tmp_path):
    payload = os.urandom(2_500_000)
    src = _stage(tmp_path, payload)
    r = _run(1, src, tmp_path / "p")
    assert r.returncode == 0, r.stdout + r.stderr
    parts = sorted(tmp_path.glob("p[0-9]*"), key=lambda p: int(p.name[1:]))
    assert [p.name for p in parts] == ["p1", "p2", "p3"]
    blobs = [next(p.glob("payload.tar.*")) for p in parts]
    assert all(b.stat().st_size <= 1_000_000 for b in blobs)
    assert b"".join(b.read_bytes() for b in sorted(blobs, key=lambda b: b.name)) == payload
    assert (parts[-1] / "NPARTS").read_text().strip() == "3"
    assert hashlib.sha256(payload).hexdigest() in (parts[-1] / "PAYLOAD_SHA256").read_text()
    again = _run(1, src, tmp_path / "p")  # never overwrites parts already there
    assert again.returncode == 2 and "already exist" in again.stdout


def test_damaged_parts_and_bad_sizes_are_refused(tmp_path):
    payload = os.urandom(2_500_000)
    src = _stage(tmp_path, payload)
    bad = _run("34MB", src, tmp_path / "p")
    assert bad.returncode == 2 and "SIZE_MB" in bad.stdout
    part = src / "c2" / "payload.tar.01"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    r = _run(1, src, tmp_path / "p")
    assert r.returncode == 3 and "sha256" in r.stdout
    assert not list(tmp_path.glob("p[0-9]*"))
