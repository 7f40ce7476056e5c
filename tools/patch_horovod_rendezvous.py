"""Close CVE-2024-10190 and its relatives in Horovod 0.28.1's runner before it is built
(tools/build_horovod.sh).

Horovod's elastic rendezvous server unpickles the body of any unauthenticated HTTP PUT to its
``worker_addresses`` scope; even read as data only, that body names the addresses the driver
dials and the HMAC key it then trusts, so whoever reaches the port makes the driver unpickle the
answer of a listener of theirs. Its function-mode key-value store unpickles whatever was PUT, its
servers bind every interface, and its interface probe puts the HMAC key on the ssh command line.
Horovod published no fix. This script edits the unpacked sdist (textual edits, each applied
exactly once or the build stops):

1. one job secret (``settings.key``) authenticates the workers: the launcher hands it to each
   process on its stdin (``IFS= read -r HOROVOD_WORKER_SECRET``), never on a command line;
   elastic workers sign their address registration with it and key their notification service
   with a key derived from it per host and slot; the driver accepts a registration only for a
   host/slot it assigned, only from that host's address, only with a valid signature, at most
   64 addresses, and keys the probe with its own derivation (the body carries no key);
2. every ``Wire.read`` checks the message length (at most 64 MiB, not negative) before reading,
   and unpickles with an unpickler that admits only Horovod's message classes (``*Request``,
   ``*Response``, ``*Signal``, its enums) and a few builtin data types;
3. HTTP request bodies are capped (rendezvous 1 MiB, function-mode store 1 GiB, answered 413);
   the function-mode key-value stores (``horovod.run()`` and elastic) refuse unsigned PUTs (403)
   and their readers check the signature, which covers scope and key, before unpickling;
4. the rendezvous and key-value servers bind the driver's address on the job's interface where
   horovodrun knows it (``--network-interface``; for non-elastic Gloo and function mode always),
   and so do the launcher's HMAC-authenticated services when they are given one interface with
   one IPv4 address;
5. a reset stops waiting for the workers of a host that discovery dropped: once every worker on
   a listed host has reported and theirs have not for 3 s, the elastic driver records them as
   failed (once: a second record of a failed slot in the same reset is refused or ignored,
   where Horovod counted it twice at its barrier) and ends their launch, so a worker behind a
   cut link no longer holds the job until the link returns; the driver sends its host-change
   notices from threads of their own, in order per worker, no longer holding its hosts lock
   while an unreachable coordinator does not answer;
6. ``horovod.runner.common.util.secret.HVD_AVERAGING_PATCH`` names this revision, so that
   hvd_averaging can warn when it runs on a Horovod without it.

    python tools/patch_horovod_rendezvous.py SOURCE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["PATCH_REVISION", "EDITS", "apply_edits", "main"]

# The revision of this patch: part of the wheel cache key, so a changed patch rebuilds Horovod.
PATCH_REVISION = "rendezvous6"

SECRET_HELPERS = '''

# hvd_averaging patch: the revision hvd_averaging checks for (it warns when this is absent).
HVD_AVERAGING_PATCH = '@REVISION@'

# The job secret's environment variable in a worker. The launcher hands it on stdin, which the
# worker's shell reads (READ_WORKER_SECRET), so that it is never on a command line.
HOROVOD_WORKER_SECRET = 'HOROVOD_WORKER_SECRET'
READ_WORKER_SECRET = ('IFS= read -r HOROVOD_WORKER_SECRET && export HOROVOD_WORKER_SECRET && ')


def derive_key(key, label):
    """A key for one purpose (``label``) derived from the job secret."""
    return hmac.new(key, b'derive:' + label.encode(), hashlib.sha256).digest()


def sign(key, label, message):
    """The HMAC of ``message`` bound to ``label`` (a scope and key), so a signed value cannot
    be replayed under another name."""
    return compute_digest(key, label.encode() + b'\\0' + message)


def check_signature(key, label, message, digest):
    return hmac.compare_digest(sign(key, label, message), digest)


def worker_secret_line(key):
    """What the launcher writes on a worker's stdin."""
    return (key.hex() + '\\n').encode('ascii')


def worker_secret_from_env():
    value = os.environ.get(HOROVOD_WORKER_SECRET, '')
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b''
    if len(key) != SECRET_LENGTH:
        raise RuntimeError('{} is missing or malformed: this process was not started by a '
                           'horovodrun that hands its workers the job secret on stdin'
                           .format(HOROVOD_WORKER_SECRET))
    return key
'''

CODEC_HELPERS = '''

def dumps_base64_signed(obj, key, label):
    """hvd_averaging patch: base64 of the signature (over ``label`` and the pickle) and the
    pickle."""
    serialized = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(secret.sign(key, label, serialized) + serialized)


def verified_payload(encoded, key, label):
    """The pickle inside a signed value, or PermissionError (it is never unpickled unsigned)."""
    try:
        decoded = base64.b64decode(encoded, validate=True)
    except (TypeError, ValueError):
        raise PermissionError('{}: refused, not base64'.format(label)) from None
    digest, payload = decoded[:secret.DIGEST_LENGTH], decoded[secret.DIGEST_LENGTH:]
    if len(digest) != secret.DIGEST_LENGTH or not secret.check_signature(key, label, payload, digest):
        raise PermissionError('{}: refused, not signed with the job secret'.format(label))
    return payload


def loads_base64_signed(encoded, key, label):
    return cloudpickle.loads(verified_payload(encoded, key, label))
'''

WIRE_UNPICKLER = '''

# hvd_averaging patch: a Wire message is read only when its length is sane, and unpickled only
# into Horovod's message classes and plain data, even when its HMAC matched.
MAX_WIRE_MESSAGE = 64 << 20
_MESSAGE_CLASS_SUFFIXES = ('Request', 'Response', 'Signal')
_DATA_BUILTINS = frozenset(('set', 'frozenset', 'bytearray', 'complex'))


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == 'builtins' and name in _DATA_BUILTINS:
            return super().find_class(module, name)
        if module.startswith('horovod.') and '.' not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module and (
                    name.endswith(_MESSAGE_CLASS_SUFFIXES) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(
            'refused: {}.{} in a Horovod service message'.format(module, name))


def _one_nic_address(nics):
    """The IPv4 address to bind when a service is given exactly one interface holding exactly
    one (all interfaces, as before, otherwise)."""
    names = [nics] if isinstance(nics, str) else list(nics or [])
    if len(names) != 1:
        return ''
    found = [a.address for a in psutil.net_if_addrs().get(names[0], [])
             if a.family == socket.AF_INET]
    return found[0] if len(found) == 1 else ''
'''

RENDEZVOUS_CHECKS = '''

# hvd_averaging patch (CVE-2024-10190): a worker's registration is accepted only for a slot the
# driver assigned, only from that host's address, only signed with the job secret, and it is read
# as data only (a dict of interface -> [(address, port)], at most MAX_WORKER_ADDRESSES pairs).
MAX_WORKER_ADDRESSES = 64


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError('refused: {}.{} in a rendezvous request'.format(module, name))


def _host_addresses(host):
    """The addresses a registration for ``host`` may come from: what ``host`` resolves to, and
    every local address when that is this machine."""
    try:
        found = set(socket.gethostbyname_ex(host)[2])
    except OSError:
        return set()
    local = network.get_local_host_addresses()
    if found & local or any(address.startswith('127.') for address in found):
        return found | local
    return found


def _assigned_slot(driver, key, client_ip):
    """(host, slot) of a registration the driver may accept; PermissionError (403) otherwise."""
    host, _, slot = key.rpartition(':')
    try:
        slot = int(slot)
    except ValueError:
        raise ValueError('refused rendezvous request: key {!r} is not host:slot'.format(key)) from None
    if not driver.has_rank_assignment(host, slot):
        raise PermissionError('refused rendezvous request: {}:{} is not an assigned slot'
                              .format(host, slot))
    if client_ip not in _host_addresses(host):
        raise PermissionError('refused rendezvous request for {}:{} from {}, not that host'
                              .format(host, slot, client_ip))
    return host, slot


def _worker_addresses(job_secret, scope, key, value):
    """The addresses of a signed registration; PermissionError (403) or ValueError (400)."""
    payload = codec.verified_payload(value, job_secret, '{}/{}'.format(scope, key))
    try:
        addresses = _DataOnlyUnpickler(io.BytesIO(payload)).load()
    except Exception as error:
        raise ValueError('refused rendezvous request: {}'.format(error)) from None
    ok = isinstance(addresses, dict) and all(
        isinstance(nic, str) and isinstance(pairs, list) and all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
            and isinstance(pair[1], int) and 0 < pair[1] < 65536 for pair in pairs)
        for nic, pairs in addresses.items())
    if not ok:
        raise ValueError('refused rendezvous request: not {interface: [(address, port)]}')
    count = sum(len(pairs) for pairs in addresses.values())
    if count > MAX_WORKER_ADDRESSES:
        raise ValueError('refused rendezvous request: {} addresses, at most {}'
                         .format(count, MAX_WORKER_ADDRESSES))
    return addresses
'''


EDITS = {
    "horovod/runner/common/util/secret.py": [
        ("    return hmac.compare_digest(computed_digest, digest)\n",
         "    return hmac.compare_digest(computed_digest, digest)\n"
         + SECRET_HELPERS.replace("@REVISION@", PATCH_REVISION)),
    ],
    "horovod/runner/common/util/codec.py": [
        ("import cloudpickle\n", "import cloudpickle\n\nfrom horovod.runner.common.util import secret\n"),
        ("    return encoded.decode('ascii') if to_ascii else encoded\n",
         "    return encoded.decode('ascii') if to_ascii else encoded\n" + CODEC_HELPERS),
    ],
    "horovod/runner/common/util/network.py": [
        ("import pickle\n", "import enum\nimport io\nimport pickle\n"),
        ("class PingRequest(object):", WIRE_UNPICKLER.lstrip("\n") + "\n\nclass PingRequest(object):"),
        ("""        message_len = struct.unpack('i', rfile.read(4))[0]
        message = rfile.read(message_len)
        if not secret.check_digest(self._key, message, digest):
            raise Exception('Security error: digest did not match the message.')
        return cloudpickle.loads(message)
""", """        message_len = struct.unpack('i', rfile.read(4))[0]
        if not 0 <= message_len <= MAX_WIRE_MESSAGE:
            raise Exception('Security error: message length {} refused.'.format(message_len))
        message = rfile.read(message_len)
        if not secret.check_digest(self._key, message, digest):
            raise Exception('Security error: digest did not match the message.')
        return _MessageUnpickler(io.BytesIO(message)).load()
"""),
        ("""        self._server, _ = find_port(
            lambda addr: socketserver.ThreadingTCPServer(
                addr, self._make_handler()))""", """        self._server, _ = find_port(
            lambda addr: socketserver.ThreadingTCPServer(
                addr, self._make_handler()), _one_nic_address(nics))"""),
    ],
    "horovod/runner/util/network.py": [
        ("def find_port(server_factory):", "def find_port(server_factory, address=''):"),
        ("            addr = ('', port)\n", "            addr = (address, port)\n"),
    ],
    "horovod/runner/http/http_server.py": [
        ("from horovod.runner.util.network import find_port\n",
         "from horovod.runner.common.util import codec\nfrom horovod.runner.util.network import find_port\n"),
        ("OK = 200\n", "OK = 200\nFORBIDDEN = 403\nPAYLOAD_TOO_LARGE = 413\n\n"
         "# hvd_averaging patch: request bodies are capped (Gloo's rendezvous values are small; a\n"
         "# function-mode store holds a pickled function and its results)\n"
         "RENDEZVOUS_MAX_BODY = 1 << 20\nKVSTORE_MAX_BODY = 1 << 30\n"),
        ("""        # Get body length
        content_length = int(self.headers['Content-Length'])
""", """        # Get body length: known, not negative, within the server's cap (hvd_averaging patch)
        try:
            content_length = int(self.headers['Content-Length'])
        except (TypeError, ValueError):
            content_length = -1
        if content_length < 0:
            self.send_status_code(BAD_REQUEST)
            self.close_connection = True
            return
        if content_length > getattr(self.server, 'max_body', RENDEZVOUS_MAX_BODY):
            logging.error('KVStore: refused a body of %d bytes', content_length)
            self.send_status_code(PAYLOAD_TOO_LARGE)
            self.close_connection = True
            return
"""),
        ("""        self._put_value(scope, key, value)
        self.send_status_code(OK)
""", """        try:
            self._put_value(scope, key, value)
        except PermissionError as error:
            logging.error('KVStore: %s', error)
            self.send_status_code(FORBIDDEN)
            return
        except ValueError as error:
            logging.error('KVStore: %s', error)
            self.send_status_code(BAD_REQUEST)
            return
        self.send_status_code(OK)
"""),
        ("""    def _put_value(self, scope, key, value):
        with self.server.cache_lock:
""", """    def _put_value(self, scope, key, value):
        secret_key = getattr(self.server, 'secret_key', None)
        if secret_key is not None:
            # function mode: its values are pickles, so only signed ones are kept
            codec.verified_payload(value, secret_key, '{}/{}'.format(scope, key))
        with self.server.cache_lock:
"""),
        ("""    def start(self, handler_cls=RendezvousHandler):
        self._httpd, port = find_port(
            lambda addr: RendezvousHTTPServer(
                addr, handler_cls, self._verbose))""",
         """    def start(self, handler_cls=RendezvousHandler, address=''):
        self._httpd, port = find_port(
            lambda addr: RendezvousHTTPServer(
                addr, handler_cls, self._verbose), address)"""),
        ("""    def __init__(self, addr, handler, verbose):
        super(KVStoreHTTPServer, self).__init__(addr, handler)
""", """    def __init__(self, addr, handler, verbose, secret_key=None):
        super(KVStoreHTTPServer, self).__init__(addr, handler)
        self.secret_key = secret_key
        self.max_body = KVSTORE_MAX_BODY
"""),
        ("""    def __init__(self, verbose):
        self.httpd = None
""", """    def __init__(self, verbose, secret_key=None):
        self.secret_key = secret_key
        self.httpd = None
"""),
        ("""    def start_server(self):
        self.httpd, port = find_port(
            lambda addr: KVStoreHTTPServer(
                addr, KVStoreHandler, self.verbose))""",
         """    def start_server(self, address=''):
        self.httpd, port = find_port(
            lambda addr: KVStoreHTTPServer(
                addr, KVStoreHandler, self.verbose, self.secret_key), address)"""),
    ],
    "horovod/runner/http/http_client.py": [
        ("def read_data_from_kvstore(addr, port, scope, key):",
         "def read_data_from_kvstore(addr, port, scope, key, secret_key=None):"),
        ("        return codec.loads_base64(resp.read())\n",
         "        body = resp.read()\n"
         "        if secret_key is not None:\n"
         "            return codec.loads_base64_signed(body, secret_key, '{}/{}'.format(scope, key))\n"
         "        return codec.loads_base64(body)\n"),
        ("def put_data_into_kvstore(addr, port, scope, key, value):",
         "def put_data_into_kvstore(addr, port, scope, key, value, secret_key=None):"),
        ("        req = Request(url, data=codec.dumps_base64(value, to_ascii=False))\n",
         "        data = codec.dumps_base64_signed(value, secret_key, '{}/{}'.format(scope, key)) \\\n"
         "            if secret_key is not None else codec.dumps_base64(value, to_ascii=False)\n"
         "        req = Request(url, data=data)\n"),
    ],
    "horovod/runner/elastic/rendezvous.py": [
        ("import logging\n", "import io\nimport logging\nimport pickle\nimport socket\n"),
        ("from horovod.runner.http.http_server import RendezvousHandler\n",
         "from horovod.runner.http.http_server import RendezvousHandler\n"
         "from horovod.runner.util import network\n"),
        ("PUT_WORKER_ADDRESSES = 'worker_addresses'\n",
         "PUT_WORKER_ADDRESSES = 'worker_addresses'\n" + RENDEZVOUS_CHECKS),
        ("""            if scope == PUT_WORKER_ADDRESSES:
                host, local_rank = key.split(':')
                addresses, secret_key = codec.loads_base64(value)
                self._put_worker_addresses(host, int(local_rank), addresses, secret_key)
""", """            if scope == PUT_WORKER_ADDRESSES:
                host, slot = _assigned_slot(driver, key, self.client_address[0])
                addresses = _worker_addresses(driver.worker_secret, scope, key, value)
                driver.register_worker_server(host, slot, addresses)
                return  # not kept: nothing reads it back
"""),
        ("""        def _put_worker_addresses(self, host, local_rank, addresses, secret_key):
            driver.register_worker_server(host, local_rank, addresses, secret_key)
""", ""),
    ],
    "horovod/runner/elastic/driver.py": [
        ("from horovod.runner.common.util import hosts, timeout\n",
         "from horovod.runner.common.util import hosts, secret, timeout\n"),
        ("""                 verbose=0):
        self._rendezvous = rendezvous
""", """                 verbose=0,
                 worker_secret=None):
        self._rendezvous = rendezvous
        # hvd_averaging patch: the job secret the launcher hands its workers on stdin
        self.worker_secret = worker_secret or secret.make_secret_key()
        # hvd_averaging patch: (reset round, time) at which a reset stops waiting for the
        # workers of dropped hosts; the last host-change notice sent to each worker
        self._release_due = None
        self._notice_threads = {}
"""),
        ("""                update_res = self._host_manager.update_available_hosts()
                if update_res != HostUpdateResult.no_update:
                    self._notify_workers_host_changes(self._host_manager.current_hosts, update_res)
                    self._wait_hosts_cond.notify_all()
""", """                update_res = self._host_manager.update_available_hosts()
                if update_res != HostUpdateResult.no_update:
                    self._notify_workers_host_changes(self._host_manager.current_hosts, update_res)
                    self._wait_hosts_cond.notify_all()
                self._release_removed_workers()
"""),
        ("""        timestamp = _epoch_time_s()
        try:
            coordinator_client.notify_hosts_updated(timestamp, update_res)
        except:
            if self._verbose >= 2:
                logging.exception('failed to notify {}[{}] of host updates'
                                  .format(coordinator_slot_info.hostname,
                                          coordinator_slot_info.local_rank))
""", """        timestamp = _epoch_time_s()
        # hvd_averaging patch: the notice goes out from a thread of its own. Sent here, it held
        # the hosts lock (discovery, and the next reset's wait for slots) for as long as the
        # coordinator took to answer: a whole cut when the coordinator's link was down. A
        # worker drops a notice older than one it has, so each waits for the one before it to
        # the same worker; another worker's notices do not wait for it.
        previous = self._notice_threads.get(coordinator_client)

        def notify():
            if previous is not None:
                previous.join()
            try:
                coordinator_client.notify_hosts_updated(timestamp, update_res)
            except Exception:
                if self._verbose >= 2:
                    logging.exception('failed to notify {}[{}] of host updates'
                                      .format(coordinator_slot_info.hostname,
                                              coordinator_slot_info.local_rank))

        thread = threading.Thread(target=notify, daemon=True)
        self._notice_threads = {coordinator_client: thread}  # older workers' notices: let go
        thread.start()
"""),
        ("""    def _notify_workers_host_changes(self, current_hosts, update_res):
""", """    def _release_removed_workers(self):
        # hvd_averaging patch: a reset waits at the barrier until every worker of the last world
        # has reported. A worker on a host that discovery has dropped (behind a cut link, on a
        # node that is going) may not report for minutes, or ever, and its launch may not end
        # before it does (ssh to a cut host). Once every worker on a listed host has reported
        # and a dropped host's have not for RELEASE_GRACE_S (a graceful removal reports within
        # that), those are recorded as failed, which lets the barrier complete without them,
        # and their launch is ended (as for a blacklisted host).
        round_id, recorded = self._worker_registry.recorded()
        listed = self._host_manager.current_hosts.available_hosts
        assigned = [(host, slot_info.local_rank)
                    for host, slots in list(self._host_assignments.items()) for slot_info in slots]
        unreported = [key for key in assigned if key not in recorded]
        if not recorded or not unreported or any(host in listed for host, _ in unreported):
            self._release_due = None
            return
        now = time.time()
        if self._release_due is None or self._release_due[0] != round_id:
            self._release_due = (round_id, now + RELEASE_GRACE_S)
            return
        if now < self._release_due[1]:
            return
        self._release_due = None
        for host in sorted({host for host, _ in unreported}):
            logging.warning('reset under way: no longer waiting for the workers of %s, '
                            'which discovery dropped', host)
            self._host_manager.get_host_event(host).set()
        for host, slot in unreported:
            # waits at the barrier, as a worker's exit does; a no-op once the round is over
            threading.Thread(target=self._worker_registry.record_released,
                             args=(host, slot, round_id), daemon=True).start()

    def _notify_workers_host_changes(self, current_hosts, update_res):
"""),
        ("""def _epoch_time_s():
""", """# hvd_averaging patch: how long a reset waits for the workers of a dropped host after every
# other worker has reported (a graceful removal's report in the same reset comes within it)
RELEASE_GRACE_S = 3


def _epoch_time_s():
"""),
        ("""    def register_worker_server(self, host, slot, addresses, secret_key):
        self._worker_clients[(host, slot)] = WorkerNotificationClient(
            addresses, secret_key, self._verbose)
""", """    def register_worker_server(self, host, slot, addresses):
        # the driver's own key for that slot, never one a request carried (hvd_averaging patch)
        key = secret.derive_key(self.worker_secret, 'notification:{}:{}'.format(host, slot))
        self._worker_clients[(host, slot)] = WorkerNotificationClient(
            addresses, key, self._verbose)
"""),
    ],
    "horovod/runner/elastic/registration.py": [
        ("""        key = (host, slot)
        with self._lock:
            if key in self._states:
                if state == FAILURE:
""", """        key = (host, slot)
        with self._lock:
            if self._states.get(key) == FAILURE:
                # hvd_averaging patch: counted as failed at this reset's barrier already (its
                # exit, or the driver stopped waiting for it): a second record would count it
                # twice and let the barrier complete one worker short
                if state == FAILURE:
                    return self._rendezvous_id
                raise RuntimeError('{}[{}] was recorded as failed in this reset; {} refused'
                                   .format(host, slot, state))
            if key in self._states:
                if state == FAILURE:
"""),
        ("""    def _wait(self, key, state, rendezvous_id):
""", """    def recorded(self):
        # hvd_averaging patch: this reset's round and the slots recorded in it, read together
        with self._lock:
            return self._rendezvous_id, set(self._states)

    def record_released(self, host, slot, rendezvous_id):
        # hvd_averaging patch: the driver stopped waiting for this slot (its host was dropped):
        # it counts as failed at the barrier of round ``rendezvous_id``, unless that round is
        # over or the slot has reported meanwhile
        self._action_event.wait()
        key = (host, slot)
        with self._lock:
            if self._rendezvous_id != rendezvous_id or key in self._states:
                return
            logging.info('record state: {}[{}] = {} (its host was dropped)'.format(host, slot, FAILURE))
            self._states[key] = FAILURE
            self._workers[FAILURE].add(key)
        try:
            self._wait(key, FAILURE, rendezvous_id)
        except Exception:
            logging.exception('released worker {}[{}] left the barrier'.format(host, slot))

    def _wait(self, key, state, rendezvous_id):
"""),
    ],
    "horovod/runner/elastic/worker.py": [
        ("""            secret_key = secret.make_secret_key()
            self._service = WorkerNotificationService(secret_key, nic, self)

            value = (self._service.addresses(), secret_key)
            put_data_into_kvstore(rendezvous_addr,
                                  rendezvous_port,
                                  PUT_WORKER_ADDRESSES,
                                  self._create_id(hostname, local_rank),
                                  value)
""", """            if not os.environ.get(secret.HOROVOD_WORKER_SECRET) and \\
                    os.environ.get('HOROVOD_ELASTIC') != '1':
                return  # not an elastic launch: no driver takes registrations
            # hvd_averaging patch: the job secret the launcher handed signs the registration and
            # keys this worker's notification service (derived per slot); no key is sent
            job_secret = secret.worker_secret_from_env()
            worker_id = self._create_id(hostname, local_rank)
            self._service = WorkerNotificationService(
                secret.derive_key(job_secret, 'notification:' + worker_id), nic, self)
            put_data_into_kvstore(rendezvous_addr,
                                  rendezvous_port,
                                  PUT_WORKER_ADDRESSES,
                                  worker_id,
                                  self._service.addresses(),
                                  secret_key=job_secret)
"""),
    ],
    "horovod/runner/common/util/safe_shell_exec.py": [
        ("def _exec_middleman(command, env, exit_event, stdout, stderr, rw):",
         "def _exec_middleman(command, env, exit_event, stdout, stderr, rw, stdin_data=None):"),
        ("""    executor_shell = subprocess.Popen(command, shell=True, env=env,
                                      stdout=stdout_w, stderr=stderr_w)
""", """    executor_shell = subprocess.Popen(command, shell=True, env=env,
                                      stdout=stdout_w, stderr=stderr_w,
                                      stdin=None if stdin_data is None else subprocess.PIPE)
    if stdin_data is not None:
        # hvd_averaging patch: a secret reaches the command on its stdin, not its command line
        try:
            executor_shell.stdin.write(stdin_data)
            executor_shell.stdin.close()
        except BrokenPipeError:
            pass
"""),
        ("""def execute(command, env=None, stdout=None, stderr=None, index=None, events=None,
            prefix_output_with_timestamp=False):""",
         """def execute(command, env=None, stdout=None, stderr=None, index=None, events=None,
            prefix_output_with_timestamp=False, stdin_data=None):"""),
        ("""                                                          (r, w)))""",
         """                                                          (r, w), stdin_data))"""),
    ],
    "horovod/runner/gloo_run.py": [
        ("from horovod.runner.common.util import env as env_util, safe_shell_exec\n",
         "from horovod.runner.common.util import env as env_util, safe_shell_exec, secret\n"),
        ("""            env=' '.join(['%s=%s' % (key, quote(value)) for key, value in env.items()
                          if env_util.is_exportable(key)]),""",
         """            env=' '.join(['%s=%s' % (key, quote(value)) for key, value in env.items()
                          if env_util.is_exportable(key) and key != secret.HOROVOD_WORKER_SECRET]),"""),
        ("""def _create_elastic_worker_fn(exec_command, run_command, env, event):
    get_command_with_env = _slot_info_to_command_fn(run_command, env)

    def create_worker(slot_info, events):
        command = get_command_with_env(slot_info)
        events = [event] + (events or [])
        return exec_command(command, slot_info, events)
""", """def _create_elastic_worker_fn(exec_command, run_command, env, event, worker_secret=None):
    get_command_with_env = _slot_info_to_command_fn(run_command, env)

    def create_worker(slot_info, events):
        command = get_command_with_env(slot_info)
        events = [event] + (events or [])
        return exec_command(command, slot_info, events, worker_secret=worker_secret)
"""),
        ("""    def _exec_command(command, slot_info, events):
        index = slot_info.rank
        host_name = slot_info.hostname
""", """    def _exec_command(command, slot_info, events, worker_secret=None):
        index = slot_info.rank
        host_name = slot_info.hostname
        stdin_data = None
        if worker_secret is not None:
            # hvd_averaging patch: the job secret goes to the worker's stdin, read by its shell
            command = secret.READ_WORKER_SECRET + command
            stdin_data = secret.worker_secret_line(worker_secret)
"""),
        ("""                                                events=all_events,
                                                prefix_output_with_timestamp=settings.prefix_output_with_timestamp)""",
         """                                                events=all_events,
                                                prefix_output_with_timestamp=settings.prefix_output_with_timestamp,
                                                stdin_data=stdin_data)"""),
        ("    global_rendezv_port = rendezvous.start()\n",
         "    global_rendezv_port = rendezvous.start(address=server_ip)\n"),
        ("""    args_list = [[slot_info_to_command(slot_info), slot_info, [event]]
                 for slot_info in host_alloc_plan]
""", """    # function mode (horovod.run()): the job secret its workers sign results with, on stdin
    worker_secret = env.get(secret.HOROVOD_WORKER_SECRET)
    worker_secret = bytes.fromhex(worker_secret) if worker_secret else None
    args_list = [[slot_info_to_command(slot_info), slot_info, [event], worker_secret]
                 for slot_info in host_alloc_plan]
"""),
        ("""                           cooldown_range=settings.cooldown_range,
                           verbose=settings.verbose)
""", """                           cooldown_range=settings.cooldown_range,
                           verbose=settings.verbose,
                           worker_secret=settings.key)
"""),
        ("    global_rendezv_port = rendezvous.start(handler)\n",
         "    # the job's interface, when given (--network-interface); common ones are known later\n"
         "    bind_ip = network.get_driver_ip(settings.nics) if settings.nics else ''\n"
         "    global_rendezv_port = rendezvous.start(handler, address=bind_ip)\n"),
        ("""        run_func_server = KVStoreServer(verbose=settings.verbose)
        run_func_server_port = run_func_server.start_server()
        put_data_into_kvstore(server_ip, run_func_server_port, 'runfunc', 'func', command_or_func)
""", """        run_func_server = KVStoreServer(verbose=settings.verbose, secret_key=driver.worker_secret)
        run_func_server_port = run_func_server.start_server(address=server_ip)
        put_data_into_kvstore(server_ip, run_func_server_port, 'runfunc', 'func', command_or_func,
                              secret_key=driver.worker_secret)
"""),
        ("        create_worker = _create_elastic_worker_fn(exec_command, run_command, env, event)\n",
         "        create_worker = _create_elastic_worker_fn(exec_command, run_command, env, event,\n"
         "                                                  driver.worker_secret)\n"),
        ("""                results[i] = read_data_from_kvstore(server_ip, run_func_server_port, 'runfunc_result', str(i))
""", """                results[i] = read_data_from_kvstore(server_ip, run_func_server_port, 'runfunc_result', str(i),
                                                    secret_key=driver.worker_secret)
"""),
    ],
    "horovod/runner/launch.py": [
        ("""        run_func_server = KVStoreServer(verbose=settings.verbose)
        run_func_server_port = run_func_server.start_server()
        put_data_into_kvstore(driver_ip, run_func_server_port,
                              'runfunc', 'func', args.run_func)
""", """        # hvd_averaging patch: signed values only, bound to the driver's address
        run_func_server = KVStoreServer(verbose=settings.verbose, secret_key=settings.key)
        run_func_server_port = run_func_server.start_server(address=driver_ip)
        put_data_into_kvstore(driver_ip, run_func_server_port,
                              'runfunc', 'func', args.run_func, secret_key=settings.key)
"""),
        ("""                results[i] = read_data_from_kvstore(driver_ip, run_func_server_port,
                                                    'runfunc_result', str(i))
""", """                results[i] = read_data_from_kvstore(driver_ip, run_func_server_port,
                                                    'runfunc_result', str(i),
                                                    secret_key=settings.key)
"""),
        ("""def _launch_job(args, settings, nics, command):
    env = os.environ.copy()
    config_parser.set_env_from_args(env, args)
""", """def _launch_job(args, settings, nics, command):
    env = os.environ.copy()
    config_parser.set_env_from_args(env, args)
    if settings.run_func_mode:
        # hvd_averaging patch: the workers sign their results with the job secret; Gloo hands it
        # on stdin, mpirun by name (-x), never on a command line
        env[secret.HOROVOD_WORKER_SECRET] = settings.key.hex()
"""),
    ],
    "horovod/runner/run_task.py": [
        ("from horovod.runner.common.util.env import get_env_rank_and_size\n",
         "from horovod.runner.common.util import secret\n"
         "from horovod.runner.common.util.env import get_env_rank_and_size\n"),
        ("    func = read_data_from_kvstore(addr, port, 'runfunc', 'func')\n",
         "    # hvd_averaging patch: values signed with the job secret the launcher handed\n"
         "    job_secret = secret.worker_secret_from_env()\n"
         "    func = read_data_from_kvstore(addr, port, 'runfunc', 'func', secret_key=job_secret)\n"),
        ("    put_data_into_kvstore(addr, port, 'runfunc_result', str(rank), ret_val)\n",
         "    put_data_into_kvstore(addr, port, 'runfunc_result', str(rank), ret_val, secret_key=job_secret)\n"),
    ],
    "horovod/runner/driver/driver_service.py": [
        ("import io\nimport os\n", "import copy\nimport io\nimport os\nfrom shlex import quote\n"),
        ("from horovod.runner.common.util import codec, safe_shell_exec\n",
         "from horovod.runner.common.util import codec, safe_shell_exec, secret\n"),
        ("""    def _exec_command(command):
        host_output = io.StringIO()
        try:
            exit_code = safe_shell_exec.execute(command,
                                                stdout=host_output,
                                                stderr=host_output)""",
         """    def _exec_command(command, stdin_data=None):
        host_output = io.StringIO()
        try:
            exit_code = safe_shell_exec.execute(command,
                                                stdout=host_output,
                                                stderr=host_output,
                                                stdin_data=stdin_data)"""),
        ("""    args_list = []
    num_hosts = len(all_host_names)
""", """    args_list = []
    num_hosts = len(all_host_names)
    # hvd_averaging patch: the HMAC key reaches the task on its stdin, not its command line
    settings_without_key = copy.copy(settings)
    settings_without_key.key = None
"""),
        ("""                    settings=codec.dumps_base64(settings))
        if host_name not in local_host_names:
            command = get_remote_command(command,""",
         """                    settings=codec.dumps_base64(settings_without_key))
        command = secret.READ_WORKER_SECRET + command
        if host_name not in local_host_names:
            command = get_remote_command(quote(command),"""),
        ("        args_list.append([command])\n",
         "        args_list.append([command, secret.worker_secret_line(settings.key)])\n"),
    ],
    "horovod/runner/task_fn.py": [
        ("from horovod.runner.common.util import codec, host_hash\n",
         "from horovod.runner.common.util import codec, host_hash, secret\n"),
        ("    settings = codec.loads_base64(sys.argv[4])\n",
         "    settings = codec.loads_base64(sys.argv[4])\n"
         "    settings.key = secret.worker_secret_from_env()  # on stdin (hvd_averaging patch)\n"),
    ],
}


def apply_edits(relative: str, text: str, edits: list[tuple[str, str]]) -> str:
    """``text`` with each edit applied; ValueError naming the file and the text when an edit's
    old text is not found exactly once (a changed Horovod needs this script redone)."""
    for old, new in edits:
        found = text.count(old)
        if found != 1:
            raise ValueError(f"{relative}: expected text found {found} times, not once:\n{old}")
        text = text.replace(old, new)
    return text


def main(source: Path) -> int:
    patched = {}
    try:
        for relative, edits in EDITS.items():
            patched[relative] = apply_edits(relative, (source / relative).read_text(), edits)
    except ValueError as error:
        print(f"patch_horovod_rendezvous: {error}", file=sys.stderr)
        return 1
    for relative, text in patched.items():  # nothing is written unless every edit applies
        (source / relative).write_text(text)
    print(f"patch_horovod_rendezvous: {PATCH_REVISION} applied to {source}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--revision":
        print(PATCH_REVISION)
        raise SystemExit(0)
    raise SystemExit(main(Path(sys.argv[1])))
