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


# --- the patch script's rule, the unpatched-Horovod warning, the attack verdicts -------------

def test_an_edit_applies_exactly_once_or_names_the_file():
    from patch_horovod_rendezvous import apply_edits
    assert apply_edits("f.py", "a b c", [("b", "B"), ("c", "C")]) == "a B C"
    for text in ("a c", "b b"):
        try:
            apply_edits("f.py", text, [("b", "B")])
        except ValueError as error:
            assert "f.py" in str(error) and ("0 times" in str(error) or "2 times" in str(error))
        else:
            raise AssertionError(f"{text!r} was patched")


def test_a_failing_edit_writes_no_file(tmp_path, monkeypatch):
    import patch_horovod_rendezvous as patch
    (tmp_path / "one.py").write_text("old one\n")
    (tmp_path / "two.py").write_text("nothing to find\n")
    monkeypatch.setattr(patch, "EDITS", {"one.py": [("old", "new")], "two.py": [("old", "new")]})
    assert patch.main(tmp_path) == 1
    assert (tmp_path / "one.py").read_text() == "old one\n"


def test_unpatched_horovod_is_named_with_the_remedy():
    from hvd_averaging.horovod_patch import unpatched_message
    message = unpatched_message(None, "0.28.1")
    assert "0.28.1" in message and "CVE-2024-10190" in message and "make install" in message
    assert unpatched_message("rendezvous3", "0.28.1") is None


def test_the_warning_is_given_once_per_process_from_hva_init(monkeypatch):
    import warnings
    import hvd_averaging.horovod_patch as horovod_patch
    from hvd_averaging import startup
    monkeypatch.setattr(horovod_patch, "patch_revision", lambda: None)
    monkeypatch.setattr(startup.hvd, "is_initialized", lambda: True)  # init returns right after
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        startup.init()
        startup.init()
    assert [w.category for w in caught] == [horovod_patch.UnpatchedHorovodWarning]
    assert caught[0].filename == startup.__file__
    monkeypatch.setattr(horovod_patch, "patch_revision", lambda: "rendezvous3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        startup.init()
    assert caught == []


def test_the_installed_horovod_carries_this_patch_revision():
    from hvd_averaging.horovod_patch import patch_revision
    from patch_horovod_rendezvous import PATCH_REVISION
    assert patch_revision() == PATCH_REVISION


def test_attack_verdicts_need_harm_at_the_release_and_quiet_refusal_when_patched():
    from security_tests import _harmed, _refused
    assert _harmed("key-carrying PUT", {"code_ran": True})
    assert not _harmed("many addresses", {"probe_connections": 10, "threads_before": 5,
                                          "threads_peak": 20})
    assert _harmed("oversized body", {"status": 200, "kept_bytes": 8 << 20})
    assert _refused("direct pickle", {"status": 403, "code_ran": False})
    assert not _refused("direct pickle", {"status": 403, "code_ran": True})
    assert not _refused("oversized body", {"status": 200, "kept_bytes": 404})
    assert not _refused("PUT to runfunc", {"status": 403, "code_ran": False,
                                           "worker_read": {"read": "RunsCode"}})


# --- the patched runner's pure pieces, in the installed Horovod ------------------------------

def test_signed_values_bind_their_scope_and_key_and_refuse_tampering():
    import pytest
    from horovod.runner.common.util import codec, secret
    key = secret.make_secret_key()
    body = codec.dumps_base64_signed({"x": 1}, key, "runfunc/func")
    assert codec.loads_base64_signed(body, key, "runfunc/func") == {"x": 1}
    for bad_key, label, value in [(key, "runfunc_result/0", body),
                                  (secret.make_secret_key(), "runfunc/func", body),
                                  (key, "runfunc/func", codec.dumps_base64({"x": 1}, to_ascii=False)),
                                  (key, "runfunc/func", b"not base64!")]:
        with pytest.raises(PermissionError):
            codec.verified_payload(value, bad_key, label)


def test_registrations_are_data_and_capped():
    import pickle
    import pytest
    from horovod.runner.common.util import codec, secret
    from horovod.runner.elastic import rendezvous
    key = secret.make_secret_key()

    def signed(value):
        return codec.dumps_base64_signed(value, key, "worker_addresses/h:0")
    ok = {"eth0": [("10.0.0.1", 4000)] * rendezvous.MAX_WORKER_ADDRESSES}
    assert rendezvous._worker_addresses(key, "worker_addresses", "h:0", signed(ok)) == ok
    for bad in [{"eth0": [("10.0.0.1", 4000)] * (rendezvous.MAX_WORKER_ADDRESSES + 1)},
                ({"eth0": [("10.0.0.1", 4000)]}, key), {"eth0": [("10.0.0.1", 0)]},
                {"eth0": [("10.0.0.1", "4000")]}]:
        with pytest.raises(ValueError):
            rendezvous._worker_addresses(key, "worker_addresses", "h:0", signed(bad))
    with pytest.raises(ValueError):  # a class inside a signed body is still refused
        rendezvous._worker_addresses(key, "worker_addresses", "h:0", signed(pickle.PickleError()))


def test_wire_reads_only_message_classes_and_sane_lengths():
    import io
    import os
    import pickle
    import struct
    import pytest
    from horovod.runner.common.util import network, secret
    from horovod.runner.elastic.worker import HostsUpdatedRequest, HostUpdateResult
    key = secret.make_secret_key()
    wire = network.Wire(key)

    def framed(message, length=None):
        return io.BytesIO(secret.compute_digest(key, message)
                          + struct.pack("i", len(message) if length is None else length) + message)
    out = io.BytesIO()
    wire.write(HostsUpdatedRequest(1.5, HostUpdateResult.added), out)
    read = wire.read(io.BytesIO(out.getvalue()))
    assert isinstance(read, HostsUpdatedRequest) and read.res == HostUpdateResult.added
    assert isinstance(wire.read(framed(pickle.dumps(network.PingResponse("s", "1.2.3.4")))),
                      network.PingResponse)

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))
    for message in [pickle.dumps(Evil()), pickle.dumps(network.Wire)]:
        with pytest.raises(pickle.UnpicklingError):
            wire.read(framed(message))
    for length in (-1, network.MAX_WIRE_MESSAGE + 1):
        with pytest.raises(Exception, match="length"):
            wire.read(framed(b"", length))


def test_a_probe_tasks_key_is_read_off_its_command_line():
    from horovod.runner.common.util import codec
    from horovod.runner.common.util.settings import BaseSettings
    from security_tests import task_keys_on_command_lines

    def task(key):
        return ["python", "-m", "horovod.runner.task_fn", codec.dumps_base64(0),
                codec.dumps_base64(2), codec.dumps_base64({}), codec.dumps_base64(BaseSettings(key=key))]
    assert task_keys_on_command_lines([task(b"k" * 32), task(None), ["python", "train.py"]]) == \
        [b"k" * 32, None]


def test_function_mode_answers_are_judged_on_results_and_command_lines():
    from security_tests import function_mode_problems
    good = {"results": [[0, 2, 1.0], [1, 2, 1.0]], "secret_seen_in_a_worker": True,
            "command_lines_with_secret": []}
    assert function_mode_problems("mpi", good) == []
    assert "printed no result" in function_mode_problems("mpi", None)[0]
    wrong = function_mode_problems("gloo", {**good, "results": [[0, 2, 1.0]]})
    assert len(wrong) == 1 and "results [[0, 2, 1.0]]" in wrong[0]
    unchecked = function_mode_problems("mpi", {**good, "secret_seen_in_a_worker": False})
    assert len(unchecked) == 1 and "could not be checked" in unchecked[0]
    leaked = function_mode_problems("mpi", {**good, "command_lines_with_secret": ["mpirun -x S=ab"]})
    assert len(leaked) == 1 and "mpirun -x S=ab" in leaked[0]
