"""Transformer Engine's core wheel for the GPU machine, cut to what one GPU architecture runs.

    python benchmarks/te_stage.py inspect WHEEL            # largest files; the fatbinary's cubins per arch
    python benchmarks/te_stage.py prune WHEEL OUT.whl [--keep 90]

`transformer_engine_cu13` ships ``libtransformer_engine.so`` with device code for sm_75 ... sm_120 in
its ``.nv_fatbin`` section (2.20.2: 89 fatbinary containers, one compressed cubin per arch, no PTX).
``prune`` rewrites each container to hold only the entries of the kept architectures (the H100 and
H200 are sm_90), lowers the container's size field to match and zero-fills the rest of its old
extent in place, so no offset, symbol or relocation of the library moves. The CUDA runtime picks a
container's entry for the device from the entries listed, so the kept cubins are used as before; the
zeros compress to almost nothing. The wheel is written again with that library and its RECORD line
updated, entries stored uncompressed (the staged payload is xz-compressed as a whole). A container
with no entry for a kept architecture is left whole.

Fatbinary layout read here (what the containers of this library hold): a container is a 16-byte
header (u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size of the entries that follow),
then entries, each a header (u16 kind: 1 PTX, 2 ELF cubin; u16; u32 header size; u64 payload size;
...; u32 architecture at byte 28) and its payload. Containers may be separated by zero padding.
"""

from __future__ import annotations

import argparse
import base64
import collections
import hashlib
import struct
import sys
import zipfile
from pathlib import Path

MAGIC = 0xBA55ED50
LIB = "transformer_engine/wheel_lib/libtransformer_engine.so"


def elf_section(data: bytes, name: str) -> tuple[int, int] | None:
    """(file offset, size) of the ELF64 little-endian section ``name``, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = headers[shstrndx][4]
    for sh_name, _type, _flags, _addr, off, size in headers:
        end = data.index(b"\0", str_off + sh_name)
        if data[str_off + sh_name:end].decode() == name:
            return off, size
    return None


def fatbin_entries(section: bytes):
    """Yield (container offset, header size, entries size, [(entry offset, entry length, kind, arch)])
    for every container of a fatbinary section (offsets relative to the section)."""
    pos = 0
    while pos + 16 <= len(section):
        magic, _version, hsize, size = struct.unpack_from("<IHHQ", section, pos)
        if magic != MAGIC:
            pos += 8  # padding between containers (8-byte aligned)
            continue
        p, end, entries = pos + hsize, pos + hsize + size, []
        if end > len(section):
            raise ValueError(f"fatbinary container at {pos} runs past the section")
        while p < end:
            kind, _u, ehsize, esize = struct.unpack_from("<HHIQ", section, p)
            arch, = struct.unpack_from("<I", section, p + 28)
            entries.append((p, ehsize + esize, kind, arch))
            p += ehsize + esize
        yield pos, hsize, size, entries
        pos = end


def prune_fatbin(section: bytes, keep: set[int]) -> tuple[bytes, dict]:
    """The section with every container reduced to its entries for the architectures in ``keep``
    (same length; see the module doc). Returns (new section, stats)."""
    out = bytearray(section)
    stats = collections.Counter()
    for pos, hsize, size, entries in fatbin_entries(section):
        kept = [section[p:p + n] for p, n, _kind, arch in entries if arch in keep]
        stats["containers"] += 1
        if not kept:
            stats["containers_left_whole"] += 1
            continue
        body = b"".join(kept)
        out[pos + hsize:pos + hsize + size] = body + bytes(size - len(body))
        struct.pack_into("<Q", out, pos + 8, len(body))
        stats["entries_kept"] += len(kept)
        stats["entries_dropped"] += len(entries) - len(kept)
        stats["bytes_zeroed"] += size - len(body)
    return bytes(out), dict(stats)


def arch_table(section: bytes) -> dict:
    """{(kind, arch): [entries, bytes]} of a fatbinary section."""
    table: dict = collections.defaultdict(lambda: [0, 0])
    for _pos, _h, _s, entries in fatbin_entries(section):
        for _p, n, kind, arch in entries:
            key = ({1: "ptx", 2: "cubin"}.get(kind, f"kind{kind}"), arch)
            table[key][0] += 1
            table[key][1] += n
    return dict(table)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def prune_wheel(src: Path, dst: Path, keep: set[int]) -> dict:
    """Write ``dst``: the wheel ``src`` with LIB's fatbinary pruned to ``keep`` and RECORD updated."""
    with zipfile.ZipFile(src) as z:
        names = z.namelist()
        lib = z.read(LIB)
        where = elf_section(lib, ".nv_fatbin")
        if where is None:
            raise ValueError(f"{LIB} has no .nv_fatbin section")
        off, size = where
        section, stats = prune_fatbin(lib[off:off + size], keep)
        lib = lib[:off] + section + lib[off + size:]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = []
        for line in z.read(record).decode().splitlines():
            path = line.split(",")[0]
            lines.append(f"{LIB},{_record_hash(lib)},{len(lib)}" if path == LIB else line)
        dst.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as out:
            for n in names:
                info = z.getinfo(n)
                data = lib if n == LIB else ("\n".join(lines) + "\n").encode() if n == record else z.read(n)
                zi = zipfile.ZipInfo(n, date_time=info.date_time)
                zi.external_attr = info.external_attr
                out.writestr(zi, data)
    return {**stats, "kept_archs": sorted(keep), "library_bytes": len(lib)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("inspect")
    i.add_argument("wheel")
    p = sub.add_parser("prune")
    p.add_argument("wheel")
    p.add_argument("out")
    p.add_argument("--keep", default="90", help="comma-separated SM numbers to keep (default 90: H100 / H200)")
    a = ap.parse_args(argv)
    if a.cmd == "inspect":
        with zipfile.ZipFile(a.wheel) as z:
            infos = sorted(z.infolist(), key=lambda x: -x.file_size)
            print(f"{len(infos)} files, {sum(x.file_size for x in infos) / 2**20:.1f} MiB unpacked, "
                  f"{sum(x.compress_size for x in infos) / 2**20:.1f} MiB in the wheel; largest:")
            for x in infos[:6]:
                print(f"  {x.file_size / 2**20:8.2f} MiB ({x.compress_size / 2**20:7.2f} in the wheel)  {x.filename}")
            lib = z.read(LIB)
        off, size = elf_section(lib, ".nv_fatbin")
        print(f"{LIB}: .nv_fatbin {size / 2**20:.1f} MiB of {len(lib) / 2**20:.1f} MiB")
        for (kind, arch), (n, b) in sorted(arch_table(lib[off:off + size]).items(), key=lambda kv: -kv[1][1]):
            print(f"  {kind} sm_{arch}: {n} entries, {b / 2**20:.2f} MiB")
        return 0
    keep = {int(x) for x in a.keep.split(",") if x}
    stats = prune_wheel(Path(a.wheel), Path(a.out), keep)
    print(f"pruned {a.wheel} -> {a.out}: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
