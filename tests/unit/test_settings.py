"""The HVA_* settings: the list is complete (every variable the library reads, in the docs with
its rule), the message when ranks disagree (pure), and hva.init() refusing ranks that disagree
(a real two-rank horovodrun launch)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_averaging.env_settings import SETTINGS, settings_disagreement

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def variables_read_by_the_library() -> set[str]:
    found = set()
    for path in (ROOT / "hvd_averaging").rglob("*.py"):
        if "examples" in path.parts:
            continue  # the demo's own options are not the library's settings
        found |= set(re.findall(r"\bHVA_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    return found


def test_every_hva_variable_the_library_reads_is_listed():
    assert variables_read_by_the_library() == set(SETTINGS)


@pytest.mark.parametrize("doc", ["docs/api.md", "docs/reliability.md"])
def test_the_docs_name_every_setting(doc):
    text = (ROOT / doc).read_text()
    assert [name for name in SETTINGS if f"`{name}`" not in text] == []


def test_agreeing_ranks_give_no_message():
    assert settings_disagreement({"HVA_ROUTE": ["'flat'"] * 3, "HVA_TIMEOUT_SECONDS": ["'45'"] * 3}) \
        is None


def test_a_disagreement_names_each_setting_and_its_ranks():
    message = settings_disagreement({
        "HVA_ROUTE": ["'flat'", "'measure'", "'flat'", "'node-aware'"],
        "HVA_TIMEOUT_SECONDS": ["'45'"] * 4,
        "HVA_WATCHDOG_RECORD_DIR": ["(unset)", "(unset)", "'/shared/records'", "(unset)"]})
    assert message.startswith("HVA_ROUTE differs across ranks: 'flat' on rank(s) [0, 2]; "
                              "'measure' on rank(s) [1]; 'node-aware' on rank(s) [3]. "
                              "HVA_WATCHDOG_RECORD_DIR differs across ranks: (unset) on rank(s) "
                              "[0, 1, 3]; '/shared/records' on rank(s) [2]. Every rank must")
    assert "HVA_TIMEOUT_SECONDS" not in message


INIT_WITH_ONE_RANK_DIFFERENT = """
import os
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK"))
if rank == "1":
    os.environ["HVA_ROUTE"] = "flat"
import hvd_averaging as hva
try:
    hva.init()
except ValueError as error:
    print(f"rank {rank} refused: {error}", flush=True)
    raise SystemExit(3)
print(f"rank {rank} started", flush=True)
"""


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_init_refuses_ranks_whose_settings_differ(controller):
    """horovodrun -np 2 where rank 1 alone has HVA_ROUTE=flat: hva.init() raises ValueError on
    both ranks naming HVA_ROUTE and the ranks. At the commit before this test both ranks
    started (the values were checked per rank only)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env.pop("HVA_ROUTE", None)
    proc = subprocess.run([str(BIN / "horovodrun"), f"--{controller}", "-np", "2", "-H",
                           "localhost:2", str(BIN / "python"), "-c", INIT_WITH_ONE_RANK_DIFFERENT],
                          capture_output=True, text=True, timeout=240, env=env,
                          start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for rank in (0, 1):
        assert (f"rank {rank} refused: HVA_ROUTE differs across ranks: 'measure' on rank(s) [0]; "
                f"'flat' on rank(s) [1]") in out, out
    assert "started" not in out
