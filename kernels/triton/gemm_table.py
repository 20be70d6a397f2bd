"""Measured GEMM tile picks per GPU model: which config of ``kernels.triton.gemm.CONFIGS`` is fastest
for a layer shape and a row count, read from a table that a sweep on that GPU wrote.

Why a table: the heuristic picks of ``gemm.pick_config`` come from sweeps of a few shapes on one
GPU; a model's own shapes (a 1,536-wide Qwen2 layer, a 7,168-wide DeepSeek one) and another GPU
(H100 vs H200) have other winners. Every config gives the same bits for a given (K, N, k_segments)
(``test_gemm_all_configs_identical``), so a table changes speed only, never a number: the learner
and the engine may even use different tables and stay bitwise equal.

Format (``gemm_tables/<device slug>.json``, written by ``benchmarks/gpu_kernels.py --sweep
--table-out``)::

    {"device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "command": "...",
     "entries": {"1536,8960,8": [[1, "d16_n64_split_mt"], [32, "m64_n128_split_mt"], ...], ...}}

An entry's key is ``"K,N,k_segments"``; its list holds ``[M, config name]`` rows sorted by the row
count they were measured at. A call with M rows takes the row with the smallest measured M >= M;
a call with more rows than the largest measured M falls back to the heuristic (the table says
nothing about shapes it did not time).

Which table (``kernels.settings.set_gemm_table``, recipe ``runtime.gemm_table``, env
``RZ_GEMM_TABLE``): ``auto`` (the default) reads ``gemm_tables/<slug of torch.cuda.get_device_name()>.json``
where one exists; ``off`` uses the heuristic only; anything else is the path of a table file (what a
GPU session uses to time a table it has just measured, before committing it).
"""

from __future__ import annotations

import bisect
import json
import os
import re
from pathlib import Path
from typing import Optional

__all__ = ["TABLE_DIR", "device_slug", "load_table", "lookup", "table_path", "validate_table", "GemmTableError"]

TABLE_DIR = Path(__file__).with_name("gemm_tables")


class GemmTableError(ValueError):
    """A GEMM table that cannot be used (missing file, bad format, unknown config name)."""


def device_slug(name: str) -> str:
    """File-name form of a GPU's name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def table_path(setting: str, device_name: Optional[str]) -> Optional[Path]:
    """The table file a setting names for this device, or None (heuristic only)."""
    if setting == "off":
        return None
    if setting == "auto":
        if not device_name:
            return None
        p = TABLE_DIR / f"{device_slug(device_name)}.json"
        return p if p.is_file() else None
    p = Path(setting)
    if not p.is_file():
        raise GemmTableError(f"runtime.gemm_table / RZ_GEMM_TABLE: {setting!r} is not a file; "
                             "give 'auto', 'off' or the path of a table written by gpu_kernels.py --sweep --table-out")
    return p


def validate_table(doc: dict, config_names) -> dict[tuple[int, int, int], tuple[list[int], list[str]]]:
    """Check a table document and return it indexed: (K, N, k_segments) -> (sorted Ms, config names)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), dict):
        raise GemmTableError("GEMM table: expected a JSON object with an 'entries' object")
    out = {}
    for key, rows in doc["entries"].items():
        try:
            K, N, seg = (int(v) for v in key.split(","))
        except ValueError:
            raise GemmTableError(f"GEMM table: entry key {key!r} is not 'K,N,k_segments'") from None
        if not isinstance(rows, list) or not rows:
            raise GemmTableError(f"GEMM table: entry {key!r} has no [M, config] rows")
        pairs = []
        for row in rows:
            if not (isinstance(row, (list, tuple)) and len(row) == 2 and isinstance(row[0], int) and row[0] > 0):
                raise GemmTableError(f"GEMM table: entry {key!r}: row {row!r} is not [M > 0, config name]")
            if row[1] not in config_names:
                raise GemmTableError(f"GEMM table: entry {key!r}: config {row[1]!r} is not one of "
                                     "kernels.triton.gemm.CONFIGS (a table from another version of the kernels?)")
            pairs.append((int(row[0]), str(row[1])))
        pairs.sort()
        ms = [m for m, _ in pairs]
        if len(set(ms)) != len(ms):
            raise GemmTableError(f"GEMM table: entry {key!r} names one M twice")
        out[(K, N, seg)] = (ms, [c for _, c in pairs])
    return out


def load_table(path: Path, config_names) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GemmTableError(f"GEMM table {path}: cannot be read as JSON ({e})") from None
    return validate_table(doc, config_names)


def lookup(index: dict, M: int, K: int, N: int, k_segments: int) -> Optional[str]:
    """The table's config name for this call, or None (shape not in the table, or M above its rows)."""
    hit = index.get((K, N, k_segments))
    if hit is None:
        return None
    ms, names = hit
    i = bisect.bisect_left(ms, M)
    return names[i] if i < len(ms) else None


def setting_from_env() -> str:
    return os.environ.get("RZ_GEMM_TABLE", "auto") or "auto"
