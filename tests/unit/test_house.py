"""The transformers integration's house rules, checked on the tree:

* its modules import in one direction: ``state`` <- ``checks`` (data and what it says of a
  model: the bottom) <- ``attention`` <- ``families/`` and ``mixers/`` <- ``convert`` and
  ``batch`` <- ``context`` <- ``__init__`` (the face); no arrow back up, no circle, and no function-level import of a
  module of the package (one placed to dodge a cycle);
* no module named ``_more``, ``_misc``, ``utils`` or by arrival order;
* the Eagle3 library (``eagle3/``) imports neither the integrations nor the programs, at
  any depth (ModelOpt's and SpecForge's Eagle3 trainers in ``integrations/`` import it;
  the transformers integration hands ``eagle3.target`` its loader of "ringattn" targets);
* the families ``convert`` serves and those it refuses come from the mechanism files'
  tables alone, and docs/models.md's survey says the same of each: exact or refused.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "ringattn"
PACKAGE = SRC / "integrations" / "transformers"
LEVELS = {"state": 0, "checks": 1, "attention": 2, "families": 3, "mixers": 3, "convert": 4,
          "batch": 4, "head": 4, "tiled_mlp": 4, "context": 5, "__init__": 6}
"""Each module's (or subpackage's) level: a module imports only from lower levels, or from
its own subpackage."""


def _unit(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def _imports(path: Path):
    """(module-level?, target unit or None, line) of each import of the package's modules."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0: a module of the package itself
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        up = node.level - 1 - depth  # >= 0: the import climbs out of a subpackage
        if up > 0 or (up == 0 and node.level - 1 < depth):
            continue  # above the package (ringattn's core): allowed
        parts = (node.module or "").split(".")
        if node.level - 1 == depth:  # relative to the package itself
            target = parts[0] if parts[0] else None
            names = [a.name for a in node.names] if target is None else []
            targets = [target] if target else names
        else:  # within its own subpackage
            targets = [path.relative_to(PACKAGE).parts[0]]
        for target in targets:
            yield id(node) in top, target, node.lineno


def test_the_package_imports_in_one_direction():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        level = LEVELS[unit]
        for module_level, target, line in _imports(path):
            where = f"{path.relative_to(PACKAGE)}:{line}"
            if not module_level:
                bad.append(f"{where}: a function-level import of the package's {target}")
            elif target != unit and LEVELS.get(target, -1) >= level and unit != "__init__":
                bad.append(f"{where}: {unit} (level {level}) imports {target} "
                           f"(level {LEVELS.get(target)})")
    assert not bad, bad
    names = {p.stem for p in (ROOT / "src" / "ringattn" / "integrations").rglob("*.py")}
    assert not names & {"_more", "_misc", "utils", "misc", "more"}, names


ABOVE = {"eagle3": ("integrations", "apps")}
"""ringattn's subpackages that import nothing of the subpackages named (module-level or in
a function, relative or absolute, or by ``importlib.import_module``)."""


def _ringattn_imports(source: str, package: str):
    """(dotted name, line) of each module under ringattn that ``source``, a module of
    ``package`` ("ringattn.eagle3"), imports; ``from X import a`` names X and X.a."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) in ("import_module", "__import__") and node.args \
                and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        else:
            continue
        for name in names:
            if name.startswith("ringattn."):
                yield name, node.lineno


@pytest.mark.parametrize("source", [
    "from ..integrations import transformers as ra_hf", "from .. import integrations",
    "import ringattn.integrations.transformers", "from ringattn.apps import train",
    "def f():\n    from ...integrations.transformers import convert",
    "importlib.import_module('ringattn.integrations.transformers')"])
def test_an_import_of_the_integrations_is_seen(source):
    package = "ringattn.eagle3.sub" if "..." in source else "ringattn.eagle3"
    seen = [name for name, _ in _ringattn_imports(source, package)]
    assert any(name.split(".")[1] in ABOVE["eagle3"] for name in seen), (source, seen)


def test_eagle3_imports_no_integration():
    bad = []
    for unit, forbidden in ABOVE.items():
        for path in sorted((SRC / unit).rglob("*.py")):
            package = ".".join(("ringattn",) + path.relative_to(SRC).parent.parts)
            for name, line in _ringattn_imports(path.read_text(), package):
                if name.split(".")[1] in forbidden:
                    bad.append(f"{path.relative_to(SRC)}:{line}: {unit}/ imports {name}")
    assert not bad, bad


def test_served_and_refused_families_from_the_tables_match_the_docs():
    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.transformers import checks

    served = {**{f: f"attention: {m}" for f, m in checks.ATTENTION_FAMILIES.items()},
              **{f: f"mixers: {m}" for f, m in checks.MIXER_FAMILIES.items()}}
    refused = {**checks.REFUSED, **dict.fromkeys(checks._TOP_K_KEYS, "indexer top-k keys"),
               **dict.fromkeys(checks._OWN_MASKS, "a dense mask of its own")}
    # refused unconverted, served by convert (doge's own mask: families/score_bias.py)
    refused = {f: why for f, why in refused.items() if f not in served}
    assert ra_hf.CONVERTIBLE == frozenset(checks.MIXER_FAMILIES)
    assert len(served) == 47 and not refused, (sorted(served), sorted(refused))
    assert not set(served) & set(refused)
    rows = {}
    for line in (ROOT / "docs" / "models.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 5 and cells[1] and " " not in cells[1]:
            rows[cells[1]] = cells[-2]  # the survey's row (the last table naming it)
    for family, table in (*((f, served) for f in served), *((f, refused) for f in refused)):
        name = family if family in rows else family.removesuffix("_text")
        assert name in rows, f"docs/models.md's survey has no row for {family}"
        want = "exact" if table is served else "refused"
        first = rows[name].split(";")[0]  # RecurrentGemma: "plain exact (...); left-padded ..."
        assert want in first and (want == "exact" or first.startswith(want)), \
            (family, table[family], rows[name][:80])



def _pinned(source: str):
    """A function ``f`` made from ``source``, readable by ``inspect``."""
    import importlib.util
    import tempfile

    path = Path(tempfile.mkdtemp()) / "pinned_case.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"pinned_{abs(hash(source))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pinned_source_is_its_code_not_its_words():
    from ringattn.integrations.transformers import checks

    a = _pinned('def f(x):\n    """A docstring."""\n    return x + 1  # a comment\n')
    b = _pinned("def f(x):\n    '''Another one.'''\n    # spacing and comments only\n"
                "    return x+1\n")
    c = _pinned('def f(x):\n    """A docstring."""\n    return x - 1  # a comment\n')
    da, db, dc = (checks.source_digest(m.f) for m in (a, b, c))
    assert da == db != dc and checks.source_digest(len) is None
    assert checks.pinned_problem(a, {"f": db}) is None
    assert "f" in checks.pinned_problem(c, {"f": da})
    assert "missing" in checks.pinned_problem(a, {"missing": da})
