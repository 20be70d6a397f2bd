"""The bad-input contract the CLI tests check: a refused command is one ``rz: error:`` line on
stderr, exit code 2, no traceback, and the working directory's tree untouched."""

from __future__ import annotations

from pathlib import Path

from megatron_rz import cli


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def assert_refused(workdir: Path, capsys, argv, fragments) -> None:
    before = tree(workdir)
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rz: error: "), err
    assert "Traceback" not in err + out
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert tree(workdir) == before, "a bad input wrote or deleted something"
