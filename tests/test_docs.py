"""The documentation names only what exists, and depends on nothing outside the repository.

Every module or file that a docstring (module, class or function, in ``simulator/``,
``real_engine/``, ``benchmarks/``, ``notebooks/`` and ``tests/``), ``README.md``,
``DEVELOPING.md`` or the notebooks', benchmarks' and profiles' READMEs name must exist
in the checkout (``data/``'s READMEs cite their upstream repositories' paths, so they
are not read):

- a path under one of the project's top folders (``simulator/loops/compiled/plan.py``,
  ``real_engine/engine.py``, ``benchmarks/sim_speed.py``, ``scenarios/quickstart.yaml``,
  ``notebooks/...``, ``profiles/...``, ``data/...``, ``tests/...``), with or without a
  trailing ``/`` for a folder; a path with a ``.py`` module may carry ``:name`` or
  ``::test`` after it, which is ignored;
- a dotted module name such as ``simulator.cost.physics`` or ``real_engine.engine`` (a
  trailing part may be an attribute of the longest existing module:
  ``simulator.cost.step_ms`` is fine when ``simulator/cost/__init__.py`` defines or
  imports ``step_ms``);
- a shortened path inside ``simulator/`` written from its package, such as
  ``kv/rules.py`` or ``model/kv/rules``: it must be the tail of some file's path;
- a dotted module named from inside the package in double backticks
  (``loops.compiled``, ``cost.physics``, ``wire.per_request.Wire``): the tail of a
  module's path, then at most one name it defines.

Paths a command *writes* (``results/...``, ``profiles/my-calibrated.json``,
``profiles/cpu-tiny.json`` from ``latsim profile``) are outputs, not references; the
few that README names are listed in ``OUTPUTS`` (each with the command that makes it).

No docstring or document may lean on documents that are not in the repository: the
``shared`` folder beside the checkout (absent from a clone), its design document, or "the
seed(s)" meaning the design articles the project started from. Facts taken from them are kept, attributed, in
``data/README.md`` (*Facts from two design articles*); a docstring states the mechanism
and may cite that section. ("the seed" meaning an RNG seed is fine: the check looks for
the articles' phrasings, which an RNG seed never takes.)

The check is static (``ast`` and regular expressions; nothing is imported), so it runs
in well under a second. ``test_a_removed_file_is_found`` shows it fails when a named
file disappears.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = ("README.md", "DEVELOPING.md", "notebooks/README.md", "benchmarks/README.md",
             "profiles/README.md")
CODE_DIRS = ("simulator", "real_engine", "benchmarks", "notebooks", "tests")
TOPS = ("simulator", "real_engine", "benchmarks", "scenarios", "notebooks", "profiles",
        "data", "tests")

# Paths README names as what a command writes (they need not exist before it runs).
OUTPUTS = {
    "profiles/cpu-tiny.json",        # latsim profile --model tiny --device cpu --out ...
    "profiles/my-calibrated.json",   # latsim calibrate ... --out ...
    "profiles/my-server.json",       # latsim calibrate my-server.yaml ... --out ...
}

_PATH = re.compile(
    r"(?<![\w./-])(?:\.\./)?((?:%s)/[A-Za-z0-9_.*/{},-]*[A-Za-z0-9_/])" % "|".join(TOPS))
_DOTTED = re.compile(r"(?<![\w./-])((?:simulator|real_engine)(?:\.[A-Za-z_]\w*)+)")
# A module named from inside the package (``loops.compiled``, ``cost.physics``,
# ``wire.per_request.Wire``) in double backticks: its first part is one of these
# subpackages (not a YAML section such as ``model.cost`` or ``engine.kv``).
_REL_DOTTED = re.compile(
    r"``((?:cost|loops|wire|scheduling|compiled|calibration|catalog|roofline|deploy|planning|"
    r"config|policies)(?:\.[A-Za-z_]\w*)+)``")
# ``kv/rules.py``, ``model/kv/rules``, ``cost/calibration/settings.py`` in backticks:
_SHORT = re.compile(r"`([a-z_]+(?:/[a-z_]+)+(?:\.py)?/?)`")
# Documents outside the repository: the sibling folder, or the design articles the project
# started from ("the seed's score", "the seeds' measure", "the high-concurrency seed").
# An RNG seed is never written possessively nor with those adjectives.
_OUTSIDE = re.compile(
    r"\.\./" r"shared|\bDESIGN\.md|\bseed's|\bseeds'|\b(?:high-concurrency|end-to-end)\s+seed|"
    r"\bseed\s+(?:article|document|text)s?|\bthe\s+seeds\b(?!\s*(?:=|:|of\b|per\b|alone|"
    r"listed|given|run|the))", re.IGNORECASE)


@functools.lru_cache(maxsize=1)
def _files() -> frozenset:
    """Every file under the project's top folders (relative, ``/``-separated): not a
    virtual environment, a build or a results folder beside them."""
    return frozenset(p.relative_to(ROOT).as_posix() for top in TOPS
                     for p in (ROOT / top).rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)


class Index:
    """Fast look-ups over a file list: folders, paths without their extension, and every
    tail of a path (``kv/rules.py`` of ``simulator/model/kv/rules.py``)."""

    def __init__(self, files) -> None:
        self.files = set(files)
        self.dirs, self.stems, self.tails, self.dir_tails = set(), set(), set(), set()
        for f in self.files:
            parts = f.split("/")
            code = parts[0] in ("simulator", "real_engine")   # short names: code only
            for i in range(1, len(parts)):
                self.dirs.add("/".join(parts[:i]))
                if code:
                    for j in range(i):
                        self.dir_tails.add("/".join(parts[j:i]))
            if "." in parts[-1]:
                self.stems.add(f.rsplit(".", 1)[0])
            if code:
                for j in range(len(parts)):
                    self.tails.add("/".join(parts[j:]))


def docstrings(path: Path):
    """(line, text) of every module, class and function docstring in ``path``. Only
    statements are visited (a docstring is the first statement of a body), not every
    expression: ``ast.walk`` would cost seconds over the project."""
    out = []

    def visit(node) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(node, field, ()) or ():
                if isinstance(child, (ast.stmt, ast.excepthandler)):
                    visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return out


@functools.lru_cache(maxsize=1)
def sources() -> tuple:
    """(where, text) of every document this test reads: README, DEVELOPING, docstrings."""
    return tuple(_sources())


def _sources():
    for name in DOC_FILES:
        p = ROOT / name
        if p.exists():
            yield name, p.read_text(encoding="utf-8")
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            for line, doc in docstrings(p):
                yield f"{rel}:{line}", doc


def _exists_path(ref: str, ix: Index) -> bool:
    ref = ref.rstrip("/.,")
    ref = re.split(r"::|:(?=[A-Za-z_])", ref)[0]
    if ref in OUTPUTS:
        return True
    if "{" in ref:                                   # loops/compiled/{plan,loop}.py
        head, rest = ref.split("{", 1)
        alts, tail = rest.split("}", 1) if "}" in rest else (rest, "")
        return all(_exists_path(head + a + tail, ix) for a in alts.split(","))
    if "*" in ref:                                   # profiles/*.json
        pat = re.compile(re.escape(ref).replace(r"\*", "[^/]*") + "$")
        return any(pat.match(f) for f in ix.files)
    # a file, a file named without its extension (simulator/model/kv/rules), a folder
    return ref in ix.files or ref in ix.stems or ref in ix.dirs


def _module_defines(mod: str, name: str, ix: Index) -> bool:
    """``name`` is a submodule of the package ``mod`` (a path in ``ix``), or a name its
    source defines, imports or exports lazily."""
    if mod.endswith("/__init__.py"):
        pkg = mod[:-len("__init__.py")]
        if pkg + name + ".py" in ix.files or pkg + name + "/__init__.py" in ix.files:
            return True
        if (ROOT / (pkg + name + ".py")).exists() or (ROOT / pkg / name).is_dir():
            return False                              # a submodule taken out of ``ix``
    text = (ROOT / mod).read_text(encoding="utf-8")
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def _exists_dotted(ref: str, ix: Index) -> bool:
    parts = ref.rstrip(".").split(".")
    for i in range(len(parts), 0, -1):
        base = "/".join(parts[:i])
        for mod in (base + "/__init__.py", base + ".py"):
            if mod in ix.files:
                rest = parts[i:]
                return not rest or _module_defines(mod, rest[0], ix)
    return False


def _exists_relative(ref: str, ix: Index) -> bool:
    """``loops.compiled.plan`` / ``cost.physics.step_ms``: the longest run of its parts that
    is a module of ``simulator/`` or ``real_engine/`` (by its path's tail), then at most
    one name that module defines."""
    if ref.endswith((".json", ".yaml", ".yml", ".csv")):
        return True                                   # a file name (``config.json``)
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        tail = "/".join(parts[:i])
        mods = [f for f in ix.files if f.startswith(("simulator/", "real_engine/"))
                and (f.endswith("/" + tail + ".py") or f.endswith("/" + tail + "/__init__.py"))]
        if mods:
            return len(parts) == i or any(_module_defines(m, parts[i], ix) for m in mods)
    return False


def _exists_short(ref: str, ix: Index) -> bool:
    ref = ref.rstrip("/")
    if ref.endswith(".py"):
        return ref in ix.tails
    return ref + ".py" in ix.tails or ref in ix.dir_tails


def missing_references(files: set[str] | None = None):
    """Every (where, name) a document names that the checkout does not hold."""
    files = _files() if files is None else files
    ix = Index(files)
    packages = {part for f in files if f.endswith(".py") and f.split("/")[0] in
                ("simulator", "real_engine") for part in f.split("/")[1:-1]}
    out = []
    for where, text in sources():
        for m in _PATH.finditer(text):
            if not _exists_path(m.group(1), ix):
                out.append((where, m.group(1)))
        for m in _DOTTED.finditer(text):
            if not _exists_dotted(m.group(1), ix):
                out.append((where, m.group(1)))
        for m in _REL_DOTTED.finditer(text):
            if not _exists_relative(m.group(1), ix):
                out.append((where, m.group(1)))
        for m in _SHORT.finditer(text):
            ref = m.group(1)
            if ref.split("/")[0] in TOPS or ref.split("/")[0] not in packages:
                continue      # a full path (checked above), or another project's file
            if not _exists_short(ref, ix):
                out.append((where, ref))
    return out


def outside_references():
    """Every (where, phrase) of a docstring or document that points outside the repository."""
    out = []
    for where, text in sources():
        for m in _OUTSIDE.finditer(text):
            out.append((where, m.group(0)))
    return out


def test_every_named_module_and_file_exists():
    missing = missing_references()
    assert not missing, "named but not in the repository:\n" + "\n".join(
        f"  {w}: {r}" for w, r in missing)


def test_no_docstring_cites_documents_outside_the_repository():
    found = outside_references()
    assert not found, "docstrings citing documents outside the repository:\n" + "\n".join(
        f"  {w}: {r!r}" for w, r in found)


def test_a_removed_file_is_found():
    """Without ``simulator/loops/simpy/replica.py`` (named by path in DEVELOPING.md and
    docstrings) and ``simulator/wire/per_request.py`` (named as ``wire.per_request.Wire``
    in ``simulate``'s docstring) in the file list, the check names both."""
    files = _files()
    gone = {"simulator/loops/simpy/replica.py", "simulator/wire/per_request.py"}
    assert gone <= files
    missing = {r for _, r in missing_references(files - gone)}
    assert "simulator/loops/simpy/replica.py" in missing, missing
    assert "wire.per_request.Wire" in missing, missing
    assert not missing_references(files)


def test_readme_yaml_reference_is_the_scenario_tree():
    """README's *YAML reference* is what ``simulator.config.reference`` generates from the
    scenario's pydantic models and every registered plug-in kind: a key added without
    regenerating it (or a key removed) fails here."""
    from simulator.config.reference import BEGIN, END, markdown
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "README.md has no YAML reference markers"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert block == markdown(), ("README.md's YAML reference is out of date: paste the output "
                                 "of `python -m simulator.config.reference` between its markers")


def test_every_command_is_documented_in_the_readme():
    """Each ``latsim`` command (and each ``latsim trace`` subcommand) appears in README as
    ``latsim <command>``."""
    from simulator.cli.main import COMMANDS
    from simulator.cli.trace import trace_app
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    names = [n for n, _m, _a in COMMANDS] + [
        "trace " + (c.name or c.callback.__name__) for c in trace_app.registered_commands]
    missing = [n for n in names if f"latsim {n}" not in text]
    assert not missing, f"commands README.md does not show: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_and_developing_links_resolve():
    """Every ``](#anchor)`` link of README.md and DEVELOPING.md names a heading of its
    file, and every ``](FILE)`` link a file of the checkout."""
    bad = []
    for name in ("README.md", "DEVELOPING.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        anchors = {_slug(h) for h in re.findall(r"(?m)^#+ (.+)$", text)}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("#"):
                if target[1:] not in anchors:
                    bad.append(f"{name}: {target}")
            elif "://" not in target and not (ROOT / target.split("#")[0]).exists():
                bad.append(f"{name}: {target}")
    assert not bad, bad


# Modules and classes the history renamed or deleted (``git log --diff-filter=DR``): a
# document naming one is out of date (their successors in parentheses).
RETIRED = {
    "FastLoop": "loops/compiled/loop.py", "FastReplica": "loops/compiled/replica.py",
    "FastApply": "loops/simpy/apply.py ReplicaApply", "fastloop": "loops.compiled",
    "fastreplica": "loops.compiled", "fastapply": "loops.compiled.apply",
    "blockmanager": "model/kv/manager.py", "kvspace": "model/kv/space.py",
    "replica_memory": "loops/simpy/memory.py", "replica_apply": "loops/simpy/apply.py",
    "kvreport": "report/kv.py", "plancli": "cli/plan.py", "reportcli": "cli/report.py",
    "servecli": "cli/serve.py", "tracecli": "cli/trace.py", "config_wire": "config/wire.py",
    "nbutil": "report/notebook.py", "costmodel": "cost/",
}


def test_no_document_names_a_retired_module():
    pat = re.compile(r"(?<![\w-])(%s)(?![\w-])" % "|".join(RETIRED))
    found = [(w, m.group(1)) for w, text in sources() for m in pat.finditer(text)
             if not w.startswith("tests/test_docs.py")]
    assert not found, "retired names (now: " + ", ".join(
        f"{w}: {n} -> {RETIRED[n]}" for w, n in found) + ")"


def test_readme_test_command_is_what_ci_runs():
    """README's second quick-start command is the one ``.ci/run`` runs (CI adds only
    ``-q`` to pip), and the first installs the package and runs the quickstart."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)\n```", text.split("## What you get")[0], re.S)
    assert blocks[:2] == [
        "pip install -e . && latsim run scenarios/quickstart.yaml --out results/quickstart",
        'pip install torch==2.13.0 && pip install -e ".[dev,engine,serve]" && python -m pytest -q',
    ], blocks
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert blocks[1].replace("pip install ", "pip install -q ") in ci


# In comments (code and scenario files) an RNG's "seeds'" is common, so only the
# unambiguous phrases are looked for there.
_OUTSIDE_IN_COMMENTS = re.compile(
    r"\.\./" r"shared|\bDESIGN\.md|\b(?:high-concurrency|end-to-end)\s+seed|\bseed\s+articles?",
    re.IGNORECASE)


def test_no_comment_cites_documents_outside_the_repository():
    """Comments of the code (``#`` lines) and of the shipped scenarios cite nothing outside
    the repository either."""
    found = []
    files = [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    files += sorted((ROOT / "scenarios").glob("*.yaml"))
    for p in files:
        rel = p.relative_to(ROOT).as_posix()
        if rel in ("tests/test_docs.py", "tests/test_datasets.py"):
            continue                  # the checks themselves name what they look for
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if "#" in line and _OUTSIDE_IN_COMMENTS.search(line.split("#", 1)[1]):
                found.append(f"{rel}:{i}: {line.strip()[:80]}")
    assert not found, found


def test_the_yaml_reference_documents_latsims_kinds_not_a_processes_plugins():
    # A plug-in a test (or a user's scenario) registered earlier in the process must not
    # change the reference: test_compiled's half_budget policy, run in the same worker,
    # made the README comparison fail.
    from simulator.config.reference import markdown
    from simulator.model.policies.chunked import ChunkedPolicy
    from simulator.model.scheduling.policy import POLICIES, register_policy
    before = markdown()
    register_policy("t_docs_plugin")(type("TDocsPlugin", (ChunkedPolicy,), {}))
    try:
        assert "t_docs_plugin" in POLICIES
        assert markdown() == before
    finally:
        POLICIES.unregister("t_docs_plugin")
