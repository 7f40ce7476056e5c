"""Close CVE-2024-10190 in Horovod 0.28.1's sources before they are built (tools/build_horovod.sh).

Horovod's elastic rendezvous server unpickles (cloudpickle) the body of any unauthenticated HTTP
PUT to its ``worker_addresses`` scope, so whoever reaches its port runs code in the driver; it
also keeps that body, which holds the worker's HMAC key, readable by a GET, and its servers bind
every interface. Horovod published no fix. This script edits the unpacked sdist:

1. the PUT body is read with an unpickler that refuses every class and function (the workers
   send only a tuple of a dict of interface -> [(address, port)] and the key's bytes), its shape
   is checked, anything else is answered 400 and registers nothing; the body is no longer stored;
2. the rendezvous and key-value servers bind the driver's address on the job's interface where
   horovodrun knows it (``--network-interface``; for non-elastic Gloo jobs always), instead of
   every interface, and so do the launcher's HMAC-authenticated services (driver, task and
   elastic worker notification) when they are given one interface with one IPv4 address.

Each edit must apply exactly once, or the build stops (a new Horovod needs this script redone).

    python tools/patch_horovod_rendezvous.py SOURCE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

# The revision of this patch: part of the wheel cache key, so a changed patch rebuilds Horovod.
PATCH_REVISION = "rendezvous2"

SAFE_LOADER = '''

class _DataOnlyUnpickler(pickle.Unpickler):
    """hvd_averaging patch (CVE-2024-10190): builds data only, never a class or function."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused: {module}.{name} in a rendezvous request")


def _worker_addresses(value):
    """(addresses, secret_key) from a worker's PUT body, or ValueError (answered 400)."""
    try:
        addresses, secret_key = _DataOnlyUnpickler(io.BytesIO(base64.b64decode(value))).load()
    except Exception as error:
        raise ValueError(f"refused rendezvous request: {error}") from None
    ok = isinstance(addresses, dict) and isinstance(secret_key, (bytes, str)) and all(
        isinstance(nic, str) and isinstance(pairs, list) and all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
            and isinstance(pair[1], int) for pair in pairs)
        for nic, pairs in addresses.items())
    if not ok:
        raise ValueError("refused rendezvous request: not (addresses, key)")
    return addresses, secret_key
'''



def _bound_to_address(signature: str, server_attribute: str, factory: str) -> tuple[str, str]:
    """The edit that gives a server's start method an ``address`` to bind (default: every
    interface, as before) and passes it to ``find_port``."""
    def method(extra: str, passed: str) -> str:
        return (f"    def {signature}{extra}):\n        {server_attribute}, port = find_port(\n"
                f"            lambda addr: {factory}{passed})")
    return method("", ""), method(", address=''", ", address")


EDITS = {
    "horovod/runner/elastic/rendezvous.py": [
        ("import logging\n", "import base64\nimport io\nimport logging\nimport pickle\n"),
        ("PUT_WORKER_ADDRESSES = 'worker_addresses'\n",
         "PUT_WORKER_ADDRESSES = 'worker_addresses'\n" + SAFE_LOADER),
        ("""                addresses, secret_key = codec.loads_base64(value)
                self._put_worker_addresses(host, int(local_rank), addresses, secret_key)
""", """                addresses, secret_key = _worker_addresses(value)
                self._put_worker_addresses(host, int(local_rank), addresses, secret_key)
                return  # not kept: the body holds the worker's key, readable by any GET
"""),
    ],
    "horovod/runner/http/http_server.py": [
        ("""        self._put_value(scope, key, value)
        self.send_status_code(OK)
""", """        try:
            self._put_value(scope, key, value)
        except ValueError as error:
            logging.error('KVStore: %s', error)
            self.send_status_code(BAD_REQUEST)
            return
        self.send_status_code(OK)
"""),
        _bound_to_address("start(self, handler_cls=RendezvousHandler", "self._httpd",
                          "RendezvousHTTPServer(\n                addr, handler_cls, self._verbose)"),
        _bound_to_address("start_server(self", "self.httpd",
                          "KVStoreHTTPServer(\n                addr, KVStoreHandler, self.verbose)"),
    ],
    "horovod/runner/util/network.py": [
        ("def find_port(server_factory):", "def find_port(server_factory, address=''):"),
        ("            addr = ('', port)\n", "            addr = (address, port)\n"),
    ],
    "horovod/runner/common/util/network.py": [
        ("""        self._server, _ = find_port(
            lambda addr: socketserver.ThreadingTCPServer(
                addr, self._make_handler()))""", """        self._server, _ = find_port(
            lambda addr: socketserver.ThreadingTCPServer(
                addr, self._make_handler()), _one_nic_address(nics))"""),
        ("""class BasicService(object):""", """def _one_nic_address(nics):
    \"\"\"hvd_averaging patch: the IPv4 address to bind when the service is given exactly one
    interface holding exactly one (all interfaces, as before, otherwise).\"\"\"
    names = [nics] if isinstance(nics, str) else list(nics or [])
    if len(names) != 1:
        return ''
    found = [a.address for a in psutil.net_if_addrs().get(names[0], [])
             if a.family == socket.AF_INET]
    return found[0] if len(found) == 1 else ''


class BasicService(object):"""),
    ],
    "horovod/runner/gloo_run.py": [
        ("    global_rendezv_port = rendezvous.start()\n",
         "    global_rendezv_port = rendezvous.start(address=server_ip)\n"),
        ("    global_rendezv_port = rendezvous.start(handler)\n",
         "    # the job's interface, when given (--network-interface); common ones are known later\n"
         "    bind_ip = network.get_driver_ip(settings.nics) if settings.nics else ''\n"
         "    global_rendezv_port = rendezvous.start(handler, address=bind_ip)\n"),
        ("        run_func_server_port = run_func_server.start_server()\n"
         "        put_data_into_kvstore(server_ip, run_func_server_port, 'runfunc', 'func', command_or_func)\n",
         "        run_func_server_port = run_func_server.start_server(address=server_ip)\n"
         "        put_data_into_kvstore(server_ip, run_func_server_port, 'runfunc', 'func', command_or_func)\n"),
    ],
}


def main(source: Path) -> int:
    for relative, edits in EDITS.items():
        path = source / relative
        text = path.read_text()
        for old, new in edits:
            if text.count(old) != 1:
                print(f"patch_horovod_rendezvous: {relative}: expected text found "
                      f"{text.count(old)} times, not once:\n{old}", file=sys.stderr)
                return 1
            text = text.replace(old, new)
        path.write_text(text)
    print(f"patch_horovod_rendezvous: {PATCH_REVISION} applied to {source}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--revision":
        print(PATCH_REVISION)
        raise SystemExit(0)
    raise SystemExit(main(Path(sys.argv[1])))
