"""tools/security_tests.py's reading of ``ss -ltnpH`` and its verdict on what is exposed, and
the Horovod patch's edits applying exactly once (pure logic, one process)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from security_tests import exposed, listening_sockets  # noqa: E402

SS = """LISTEN 0      128      10.77.0.1:45011      0.0.0.0:*    users:(("python",pid=11,fd=7))
LISTEN 0      5        0.0.0.0:38211        0.0.0.0:*    users:(("horovodrun",pid=9,fd=3),("horovodrun",pid=9,fd=4))
LISTEN 0      4096     [::]:6818           [::]:*       users:(("slurmd",pid=3,fd=5))
LISTEN 0      10       127.0.0.1:5000       0.0.0.0:*    users:(("orted",pid=4,fd=9))
"""


def test_ss_lines_read_as_address_port_process():
    assert listening_sockets(SS) == [("10.77.0.1", 45011, "python"), ("0.0.0.0", 38211, "horovodrun"),
                                     ("::", 6818, "slurmd"), ("127.0.0.1", 5000, "orted")]
    assert listening_sockets("") == []


def test_everything_but_the_job_address_is_exposed():
    found = exposed(listening_sockets(SS), "10.77.0.1")
    assert [(a, n) for a, _, n in found] == [("0.0.0.0", "horovodrun"), ("::", "slurmd"),
                                             ("127.0.0.1", "orted")]


def test_patch_revision_is_printed_for_the_cache_key():
    out = subprocess.run([sys.executable, str(ROOT / "tools/patch_horovod_rendezvous.py"),
                          "--revision"], capture_output=True, text=True, check=True).stdout
    assert out.strip().startswith("rendezvous")


def test_open_mpi_and_slurm_exceptions_are_narrow():
    from security_tests import MPI_BTL_PORTS, open_mpi_own, slurm_own
    inside, outside = MPI_BTL_PORTS[0], MPI_BTL_PORTS[1] + 1
    assert open_mpi_own(("0.0.0.0", 40123, "orted")) and open_mpi_own(("::", inside, "python"))
    assert not open_mpi_own(("0.0.0.0", outside, "python"))  # a rank's other listener
    assert slurm_own(("0.0.0.0", 6817, "slurmctld"))
    assert slurm_own(("127.0.0.1", 5000, "slurmstepd"))
    assert not slurm_own(("0.0.0.0", 6818, "slurmd"))  # NoInAddrAny binds it to the node
    assert not slurm_own(("0.0.0.0", 40000, "python,slurmstepd"))
