"""docs/architecture.md is the design the code cites: every "architecture section N" in the code
is a section of it, no citation points at a design document outside the repository, and every
``file.py:name`` and file path the page names exists."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")
CODE = ("cluster", "rl_actors", "primitives", "rl_primitives", "tests", "examples", "benchmarks")


def sources() -> dict:
    out = {}
    for top in CODE:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    out[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    return out


SOURCES = sources()
TEXT = open(DOC, encoding="utf-8").read()
SECTIONS = {int(n) for n in re.findall(r"^## (\d+)\. ", TEXT, re.M)}


def cited_sections(text: str) -> set:
    """The section numbers ``text`` cites: "architecture section 4", "architecture sections 6-7"."""
    out = set()
    for first, last in re.findall(r"architecture sections? (\d+)(?:-(\d+))?", text):
        out.update(range(int(first), int(last or first) + 1))
    return out


def test_every_cited_section_is_on_the_page():
    cited = {path: cited_sections(text) - SECTIONS for path, text in SOURCES.items()}
    assert not {path: sorted(missing) for path, missing in cited.items() if missing}
    assert sum(len(cited_sections(t)) for t in SOURCES.values()) >= 20  # the code does cite it


def test_no_citation_points_outside_the_repository():
    assert not sorted(p for p, text in SOURCES.items() if p != "tests/test_architecture_doc.py" and "DESIGN" in text)


def test_the_citation_reader_sees_ranges_and_single_sections():
    assert cited_sections("see architecture sections 6-7 and architecture section 2") == {2, 6, 7}
    assert cited_sections("architecture section 8, invariant 7") == {8}


def defined(path: str) -> set:
    """Top-level function and class names of ``path``, and the methods of its classes."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


NAMED = re.findall(r"`([\w/]+\.py):(\w+)`", TEXT)
PATHS = set(re.findall(r"`((?:cluster|rl_actors|primitives|rl_primitives|tests|docs|benchmarks)/[\w/.]*)`", TEXT))


@pytest.mark.parametrize("path,name", sorted(set(NAMED)))
def test_each_function_the_page_names_is_where_it_says(path, name):
    assert name in defined(path), f"docs/architecture.md names {path}:{name}, which {path} does not define"


def test_each_path_the_page_names_exists():
    assert len(NAMED) >= 15 and len(PATHS) >= 20
    assert not sorted(p for p in PATHS if not os.path.exists(os.path.join(ROOT, p)))
