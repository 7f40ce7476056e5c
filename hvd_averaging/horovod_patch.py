"""Whether the Horovod in use carries this project's runner patch (tools/patch_horovod_rendezvous.py).

``pip install hvd_averaging`` pulls Horovod from PyPI, whose elastic rendezvous runs code that
any peer sends it (CVE-2024-10190, unfixed upstream). The patched build marks itself with
``horovod.runner.common.util.secret.HVD_AVERAGING_PATCH``; ``hva.init()`` warns when that marker
is absent, once per process under Python's default warning filter (one call site).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Optional

__all__ = ["UnpatchedHorovodWarning", "patch_revision", "unpatched_message", "warn_if_unpatched"]

class UnpatchedHorovodWarning(UserWarning):
    """The Horovod in use lacks the rendezvous patch (see docs/security.md)."""


def patch_revision() -> Optional[str]:
    """The patch revision the installed Horovod carries, or ``None`` when it carries none."""
    try:
        secret = importlib.import_module("horovod.runner.common.util.secret")
    except ImportError:
        return None
    revision = getattr(secret, "HVD_AVERAGING_PATCH", None)
    return revision if isinstance(revision, str) and revision else None


def unpatched_message(revision: Optional[str], horovod_version: str) -> Optional[str]:
    """The warning for a Horovod carrying ``revision`` (``None``: no patch), or ``None`` when it
    carries one."""
    if revision is not None:
        return None
    return (f"Horovod {horovod_version} lacks hvd_averaging's runner patch: its elastic rendezvous "
            "and function-mode store unpickle what any peer sends (CVE-2024-10190). Build the "
            "patched wheel with `make install` (tools/build_horovod.sh) or use the project's image; "
            "see docs/security.md")


def warn_if_unpatched() -> None:
    """Warn when the installed Horovod lacks the patch. The warning's location is always the
    caller's line (``hva.init``), so Python's default filter shows it once per process."""
    import horovod
    message = unpatched_message(patch_revision(), getattr(horovod, "__version__", "?"))
    if message is not None:
        warnings.warn(message, UnpatchedHorovodWarning, stacklevel=2)
