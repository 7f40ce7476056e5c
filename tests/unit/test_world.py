"""The World: one per Horovod start, what it owns, what a new one keeps (a real single-rank
Horovod in a child process, so this pytest process never initializes Horovod)."""
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import torch, horovod.torch as hvd, hvd_averaging as hva
from hvd_averaging.world import WorldFollower, current_world, renew_world
from hvd_averaging.process_sets import ProcessSetRegistry
from hvd_averaging.round_book import RoundBook
from hvd_averaging.routes import Routes

hva.init()
first = current_world()
assert first.generation == 1 and first.size == 1 and first.placement is not None
assert current_world() is first
follower = WorldFollower()
assert follower.behind() and not follower.started
follower.caught_up()
assert not follower.behind() and follower.started
p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.zeros(3)
hva.average_parameters([p])
book, registry, routes = (first.component(c) for c in (RoundBook, ProcessSetRegistry, Routes))
assert first.component(RoundBook) is book
before = hva.traffic()
assert before.local_allreduces + before.global_allreduces == 0  # one rank: nothing travels
hva.reset_traffic()
from hvd_averaging.traffic import count_round
count_round(True, 12, 0)
second = renew_world()  # what an elastic reset does
assert second.generation == 2 and current_world() is second
assert follower.behind(), "an averager must follow a new world of the same size"
assert second.placement is None  # placement is learned again in the new world
for component, old in ((RoundBook, book), (ProcessSetRegistry, registry), (Routes, routes)):
    assert second.component(component) is not old, component
assert hva.traffic().bytes == 12 and hva.traffic().global_allreduces == 1  # counters survive
print("world ok", flush=True)
"""


def test_world_generations_and_what_a_new_world_keeps():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "world ok" in proc.stdout, proc.stdout + proc.stderr


def module_level_assignments(path: Path) -> list[tuple[str, ast.AST]]:
    """(name, value) of every module-level assignment other than ``__all__``."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        found += [(t.id, node.value) for t in targets
                  if isinstance(t, ast.Name) and t.id != "__all__"]
    return found


def is_type_alias(value) -> bool:
    """``Union[...]``, ``Callable[...]``, ``Generator[...]`` or ``TypeVar(...)``."""
    return isinstance(value, ast.Subscript) or (
        isinstance(value, ast.Call) and getattr(value.func, "id", "") == "TypeVar")


# The only module-level state: the current world and the one owner of deadlines. Everything else
# assigned at module level is a constant (UPPER_CASE, frozen) or a type alias.
ALLOWED_STATE = {("world.py", "_current"), ("deadlines.py", "DEADLINES")}


def test_no_module_level_mutable_state_in_the_library():
    offenders = []
    for path in sorted((ROOT / "hvd_averaging").rglob("*.py")):
        if "examples" in path.parts:
            continue
        for name, value in module_level_assignments(path):
            if (path.name, name) in ALLOWED_STATE:
                continue
            constant = re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name)
            if not (constant or is_type_alias(value)):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


def test_model_averager_stays_thin():
    """The step, the schedule and the call: membership and level rounds live beneath it."""
    import ast
    tree = ast.parse((ROOT / "hvd_averaging" / "averagers.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelAverager"]
    assert cls.end_lineno - cls.lineno + 1 < 120
