"""benchmarks/te_stage.py on synthetic data: the fatbinary pruning that cuts Transformer Engine's core
library to sm_90 for the GPU machine keeps the kept entries byte for byte, the file length and every
other byte, and the rewritten wheel's RECORD matches its content."""

from __future__ import annotations

import base64
import hashlib
import struct
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import te_stage  # noqa: E402


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", te_stage.MAGIC, 1, 16, len(body)) + body


def _section() -> tuple[bytes, bytes, bytes]:
    e90 = _entry(2, 90, b"\x90" * 40)
    a = _container([_entry(2, 75, b"\x75" * 24), e90, _entry(2, 100, b"\x10" * 56)])
    b = _container([_entry(2, 80, b"\x80" * 16)])  # no sm_90 entry: left whole
    return a + bytes(8) + b, e90, b  # 8 bytes of padding between the containers


def test_prune_keeps_the_kept_entries_and_the_length():
    sec, e90, b = _section()
    out, stats = te_stage.prune_fatbin(sec, {90})
    assert len(out) == len(sec)
    assert stats == {"containers": 2, "containers_left_whole": 1, "entries_kept": 1, "entries_dropped": 2,
                     "bytes_zeroed": 64 + 24 + 64 + 56}
    conts = list(te_stage.fatbin_entries(out))
    assert [[arch for _, _, _, arch in c[3]] for c in conts] == [[90], [80]]
    assert out[16:16 + len(e90)] == e90  # the kept entry right after the first container's header
    first_end = len(sec) - len(b) - 8  # the first container's old extent
    assert set(out[16 + len(e90):first_end]) == {0}  # the dropped entries' bytes are zeros
    assert out[-len(b):] == b  # the other container unchanged
    assert te_stage.arch_table(sec)[("cubin", 90)] == [1, len(e90)]


def _elf(section: bytes) -> bytes:
    """A minimal ELF64 file: header, the fatbinary section, a section-name table, 3 section headers."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    sec_off = 64
    str_off = sec_off + len(section)
    shoff = str_off + len(names)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 2)
    shdrs = bytes(64)
    for name_at, off, size in ((1, sec_off, len(section)), (12, str_off, len(names))):
        h = bytearray(64)
        struct.pack_into("<IIQQQQ", h, 0, name_at, 1, 0, 0, off, size)
        shdrs += bytes(h)
    return bytes(head) + section + names + shdrs


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_prune_wheel_rewrites_the_library_and_its_record(tmp_path):
    sec, e90, _ = _section()
    lib = _elf(sec)
    other = b"print('hello')\n"
    src = tmp_path / "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl"
    record = "transformer_engine_cu13-2.20.2.dist-info/RECORD"
    with zipfile.ZipFile(src, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(te_stage.LIB, lib)
        z.writestr("transformer_engine/__init__.py", other)
        z.writestr(record, f"{te_stage.LIB},{_hash(lib)},{len(lib)}\n"
                           f"transformer_engine/__init__.py,{_hash(other)},{len(other)}\n{record},,\n")
    dst = tmp_path / "out" / src.name
    stats = te_stage.prune_wheel(src, dst, {90})
    assert stats["entries_kept"] == 1 and stats["library_bytes"] == len(lib)
    with zipfile.ZipFile(dst) as z:
        new = z.read(te_stage.LIB)
        assert len(new) == len(lib) and new[:64] == lib[:64] and new[64 + len(sec):] == lib[64 + len(sec):]
        off, size = te_stage.elf_section(new, ".nv_fatbin")
        assert [c[3][0][3] for c in te_stage.fatbin_entries(new[off:off + size])] == [90, 80]
        assert z.read("transformer_engine/__init__.py") == other
        rows = {line.split(",")[0]: line for line in z.read(record).decode().splitlines()}
        assert rows[te_stage.LIB] == f"{te_stage.LIB},{_hash(new)},{len(new)}"
        assert rows["transformer_engine/__init__.py"].endswith(f"{_hash(other)},{len(other)}")
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
