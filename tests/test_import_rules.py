"""The layout's import rules (architecture section 2; section 8, invariant 11), read from the source: every
``import`` statement of every module, inside functions and ``TYPE_CHECKING`` blocks included.

* Arrows only go down: jobs and the seeds' facade (``rl_primitives``) -> the wings (Ray,
  local) -> the loop -> rl_actors -> primitives; a module imports nothing from a room above its own.
* The loop imports no Ray and names no wing; primitives import no Ray.
* Inside primitives, the maths (``primitives.maths``) reads only the records, the hook checks,
  the padding layout and itself - no model, files, rewards or fixtures - and nothing but the
  fixtures imports the fixtures.
* No import circles among the project's modules.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("primitives", "rl_actors", "cluster", "rl_primitives")
# rooms, highest first, by module-name prefix (the longest prefix that matches decides)
ROOMS = {"cluster.jobs": 4, "cluster.__main__": 4, "rl_primitives": 4, "cluster.ray_wing": 3, "cluster.local": 3,
         "cluster.loop": 2, "rl_actors": 1, "primitives": 0}
NO_RAY = ("cluster.loop", "primitives")


def module_files() -> dict:
    """``{module name: path}`` of every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, name)
    return out


MODULES = module_files()


def imported(path: str, module: str) -> set:
    """Every module ``path`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return out


def room(module: str):
    keys = [k for k in ROOMS if module == k or module.startswith(k + ".")]
    return ROOMS[max(keys, key=len)] if keys else None


def own(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


GRAPH = {m: {i for i in imported(p, m) if own(i)} for m, p in MODULES.items()}


def test_the_rooms_cover_every_module():
    assert not [m for m in MODULES if m not in PACKAGES and room(m) is None]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_arrows_only_go_down(module):
    here = room(module)
    up = sorted(i for i in GRAPH[module] if room(i) is not None and here is not None and room(i) > here)
    assert not up, f"{module} imports from a room above its own: {up}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(NO_RAY)))
def test_no_ray_in_the_loop_or_primitives(module):
    ray = sorted(i for i in imported(MODULES[module], module) if i == "ray" or i.startswith("ray."))
    assert not ray, f"{module} imports {ray}"


def test_rl_actors_import_nothing_from_cluster():
    assert not {m: sorted(i for i in GRAPH[m] if i.startswith("cluster"))
                for m in MODULES if m.startswith("rl_actors") and any(i.startswith("cluster") for i in GRAPH[m])}


MATHS_READS = ("primitives.types", "primitives.hooks", "primitives.padding", "primitives.maths")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("primitives.maths")))
def test_the_maths_reads_no_model_files_or_fixtures(module):
    other = sorted(i for i in GRAPH[module] if i.startswith("primitives") and not i.startswith(MATHS_READS))
    assert not other, f"{module} imports {other}"


def test_only_fixtures_import_fixtures():
    users = {m: sorted(i for i in GRAPH[m] if i.startswith("primitives.fixtures"))
             for m in MODULES if m.startswith(("primitives", "rl_actors", "cluster.loop"))
             and not m.startswith("primitives.fixtures")}
    assert not {m: found for m, found in users.items() if found}


# inside primitives, the model, its environment (rewards, tools, whole rollouts) and the data and files
# above them: a subpackage imports only from those below it, so the three form no circle among them
PRIMITIVE_LAYERS = ("primitives.model", "primitives.env", "primitives.io")


def layer(module: str):
    return next((i for i, p in enumerate(PRIMITIVE_LAYERS) if module == p or module.startswith(p + ".")), None)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) is not None))
def test_the_model_reads_no_environment_and_the_environment_no_data_files(module):
    up = sorted(i for i in GRAPH[module] if layer(i) is not None and layer(i) > layer(module))
    assert not up, f"{module} imports from a layer above its own ({PRIMITIVE_LAYERS}): {up}"


def test_the_primitive_layers_form_no_circle():
    packages = {p: {q for m in MODULES if layer(m) == i for q in PRIMITIVE_LAYERS
                    if q != p and any(dep == q or dep.startswith(q + ".") for dep in GRAPH[m])}
                for i, p in enumerate(PRIMITIVE_LAYERS)}
    assert cycles(packages) == [], packages


def cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan), or a module
    importing itself."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(GRAPH) == []


def test_the_checks_see_a_circle_and_an_upward_arrow():
    """The rules are not vacuous: a made-up circle is found, and a trainer importing the Ray
    wing is an upward arrow."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert room("rl_actors.trainer") < room("cluster.ray_wing.groups")
    assert room("cluster.loop.train") < room("cluster.local") < room("cluster.jobs.cli")
    assert room("cluster.local") < room("rl_primitives.loop") == room("cluster.jobs.cli")


MAX_LINES = 450  # the size the layout was cut to; primitives' reward and data catalogues are lists of entries
SIZED = ("cluster", "rl_actors")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(SIZED)))
def test_no_file_of_the_cluster_or_the_actors_grows_past_the_layout(module):
    with open(MODULES[module]) as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_LINES, f"{MODULES[module]}: {lines} lines; cut it at a joint (docs/architecture.md)"
