"""Horovod's elastic driver and function-mode key-value store, started as horovodrun starts them,
on loopback, for tools/security_tests.py to attack.

Runs whichever Horovod runner is imported: the installed (patched) one, or Horovod 0.28.1's
released sources when tools/security_tests.py puts them first on PYTHONPATH. As
``gloo_run.launch_gloo_elastic`` does, it starts an ``ElasticDriver`` with its rendezvous handler
(one host, ``localhost``, one slot, whose worker is a thread that waits) and a ``KVStoreServer``
holding the function ``runfunc/func``. It prints one JSON line (the two ports, whether the runner
is patched and, patched, the job secret so that the test can also send a legitimate
registration), then answers lines on stdin:

- ``read_func``: read ``runfunc/func`` as ``horovod.runner.run_task`` does in each worker, and
  print what came back (``{"read": TYPE}`` or ``{"read_error": TEXT}``);
- end of input: exit.

    python tests/security/elastic_driver_harness.py
"""
import json
import os
import sys
import threading
import time

from horovod.runner.common.util import secret
from horovod.runner.elastic.discovery import FixedHosts
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.rendezvous import create_rendezvous_handler
from horovod.runner.http.http_client import put_data_into_kvstore, read_data_from_kvstore
from horovod.runner.http.http_server import KVStoreServer, RendezvousServer

PATCHED = hasattr(secret, "HVD_AVERAGING_PATCH")


def train():
    return "trained"


def main() -> None:
    job_secret = secret.make_secret_key()
    signed = {"secret_key": job_secret} if PATCHED else {}
    rendezvous = RendezvousServer(verbose=0)
    driver = ElasticDriver(rendezvous, FixedHosts({"localhost": 1}), min_num_proc=1,
                           max_num_proc=1, timeout=60,
                           **({"worker_secret": job_secret} if PATCHED else {}))
    rendezvous_port = rendezvous.start(create_rendezvous_handler(driver))
    worker_done = threading.Event()

    def idle_worker(slot_info, events):
        worker_done.wait()
        return 0, time.time()

    driver.start(1, idle_worker)  # returns once localhost:0 is assigned and its worker started
    kvstore = KVStoreServer(verbose=0, **signed)
    kvstore_port = kvstore.start_server()
    put_data_into_kvstore("127.0.0.1", kvstore_port, "runfunc", "func", train, **signed)
    print(json.dumps({"rendezvous_port": rendezvous_port, "kvstore_port": kvstore_port,
                      "patched": PATCHED, "secret": job_secret.hex() if PATCHED else None}),
          flush=True)
    for line in sys.stdin:
        if line.strip() == "read_func":
            try:
                found = read_data_from_kvstore("127.0.0.1", kvstore_port, "runfunc", "func",
                                               **signed)
                print(json.dumps({"read": type(found).__name__}), flush=True)
            except Exception as error:  # noqa: BLE001 - reported to the test, which judges it
                print(json.dumps({"read_error": f"{type(error).__name__}: {error}"}), flush=True)
    # the driver's threads (probes an attack started, the idle worker) are not waited for
    os._exit(0)


if __name__ == "__main__":
    main()
