"""A real single-machine SLURM for the tests in this directory (marker `slurm`).

The session fixture starts it with slurm/start_local.sh (installing Debian's slurm + munge when
missing) in its own state dir and ports, and stops it with slurm/stop_local.sh afterwards. The
tests are skipped only when SLURM genuinely cannot be had: not root, or apt cannot install it.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = "/tmp/rz-slurm-pytest"
SLURM_PORT = "16917"  # apart from a cluster started by hand (16817)


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs a real local SLURM (started by the tests/slurm fixture)")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def local_slurm():
    if os.geteuid() != 0:
        pytest.skip("the local SLURM needs root (apt-get, munged, slurmctld, slurmd)")
    if not (shutil.which("slurmctld") or shutil.which("apt-get")):
        pytest.skip("no SLURM installed and no apt-get to install it (Debian/Ubuntu only)")
    env = {**os.environ, "RZ_SLURM_DIR": SLURM_DIR, "RZ_SLURM_PORT": SLURM_PORT}
    res = subprocess.run(["bash", str(ROOT / "slurm" / "start_local.sh"), "--env"], capture_output=True,
                         text=True, env=env, timeout=600)
    if res.returncode == 3:  # apt-get could not install the packages (no network, no mirror)
        pytest.skip(f"apt-get could not install slurm/munge: {res.stderr.strip()[-800:]}")
    assert res.returncode == 0, f"start_local.sh failed ({res.returncode}):\n{res.stderr[-3000:]}"
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = f"{SLURM_DIR}/slurm.conf"
    yield os.environ["SLURM_CONF"]
    subprocess.run(["bash", str(ROOT / "slurm" / "stop_local.sh")], env=env, timeout=120)
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
