"""The import graph of mpipar/: no cycles, and every import points down the layers declared in
docs/architecture.md (section "Layer rules").

The graph is read from the source with the parser, never by importing it: module-level and
function-level imports alike (an import inside a function ties two modules together just the
same; it only hides the tie), relative imports resolved. Importing ``a.b.c`` runs the
``__init__`` of every package on the way, so an import depends on each package it passes
through too, except the importer's own enclosing packages, which are already being imported
when it runs; ``from pkg import name``, where ``pkg`` encloses the importer and ``name`` is no
submodule, reads pkg's ``__init__`` and does count (that ``__init__`` may import the importer
back). The root package holds only the version and is left out.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mpipar"
DOC = ROOT / "docs" / "architecture.md"


# -- the graph


def find_modules(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module and package under ``root / package``."""
    mods = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _encloses(pkg: str, module: str) -> bool:
    return module.startswith(pkg + ".")


def _from_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of what ``from <base> import ...`` names in ``module``."""
    if not node.level:
        return node.module
    here = module.split(".")
    if path.name != "__init__.py":
        here.pop()  # a plain module's relative imports start from its package
    if node.level - 1 >= len(here):
        raise ValueError(f"{path}:{node.lineno}: relative import beyond the top package")
    here = here[:len(here) - (node.level - 1)]
    return ".".join(here + ([node.module] if node.module else []))


def _loaded(name: str, importer: str, mods: dict, reads_init: bool) -> list[str]:
    """The modules of ``mods`` that importing ``name`` from ``importer`` runs (see the module
    doc); ``reads_init``: the statement takes a name defined in ``name``'s own ``__init__``."""
    parts = name.split(".")
    out = []
    for k in range(2, len(parts) + 1):  # from 2: the root package is left out
        prefix = ".".join(parts[:k])
        if prefix not in mods or prefix == importer:
            continue
        if _encloses(prefix, importer) and not (reads_init and k == len(parts)):
            continue
        out.append(prefix)
    return out


def _in_functions(tree) -> set[int]:
    """ids of the import statements that sit inside a function (at any depth)."""
    inside = set()
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def module_imports(module: str, path: Path, mods: dict) -> list[tuple[str, int, bool]]:
    """(target module, line, inside a function) of each import of ``module`` of another module
    of ``mods``; one entry per target and statement."""
    tree = ast.parse(path.read_text(), filename=str(path))
    inside = _in_functions(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, path, node)
            names = [(f"{base}.{a.name}", False) if f"{base}.{a.name}" in mods else (base, True)
                     for a in node.names]
        else:
            continue
        targets = {t for name, reads in names for t in _loaded(name, module, mods, reads)}
        out += [(t, node.lineno, id(node) in inside) for t in sorted(targets)]
    return sorted(out, key=lambda e: (e[1], e[0]))


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> tuple[dict, dict]:
    """(modules, graph): graph[m] = [(target, line, inside a function), ...]."""
    mods = find_modules(root, package)
    return mods, {m: module_imports(m, p, mods) for m, p in mods.items()}


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted({t for t, _, _ in graph.get(v, ())}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# -- the rules


def read_rules(text: str) -> tuple[list[list[str]], list[tuple[list[str], list[str], str]]]:
    """(layers, bans) of the ```layers block in the "## Layer rules" section of ``text``:
    layers highest first, each a list of names; bans as (sources, targets, the line)."""
    parts = re.split(r"^## Layer rules[^\n]*$", text, flags=re.M)
    assert len(parts) == 2, "docs/architecture.md needs exactly one '## Layer rules' section"
    block = re.search(r"^```layers\n(.*?)^```", parts[1], flags=re.S | re.M)
    assert block, "the '## Layer rules' section needs one ```layers fenced block"
    layers, bans = [], []
    for raw in block.group(1).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "!>" in line:
            left, right = line.split("!>")
            bans.append((left.split(), right.split(), line))
        else:
            layers.append(line.split())
    return layers, bans


def _matches(name: str, module: str) -> bool:
    return module == name or module.startswith(name + ".")


def layer_of(module: str, layers: list[list[str]]):
    """The index (0 = highest) of the layer whose longest name matches ``module``, or None."""
    best = None
    for i, names in enumerate(layers):
        for name in names:
            if _matches(name, module) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    return None if best is None else best[0]


def violations(graph: dict, mods: dict, layers, bans, root: Path = ROOT) -> list[str]:
    """One line per import that points up the layers or that a ban forbids."""
    out = []
    for m in sorted(graph):
        for t, line, in_fn in graph[m]:
            where = f"{mods[m].relative_to(root)}:{line}: {m} imports {t}"
            where += " (inside a function)" if in_fn else ""
            lm, lt = layer_of(m, layers), layer_of(t, layers)
            if lm is not None and lt is not None and lt < lm:
                out.append(f"{where}: upward, from layer {lm + 1} ({' '.join(layers[lm])}) "
                           f"to layer {lt + 1} ({' '.join(layers[lt])})")
            for sources, targets, rule in bans:
                if any(_matches(s, m) for s in sources) and any(_matches(d, t) for d in targets):
                    out.append(f"{where}: forbidden by `{rule}`")
    return out


# -- the checks of the checker


def _tree(tmp_path, files: dict) -> Path:
    for name, text in files.items():
        f = tmp_path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


def test_the_scanner_resolves_imports(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from .b import thing\n",
        "pkg/a.py": "import os\nfrom . import b\n'from pkg import c'\ndef f():\n"
                    "    from .sub.c import X\n",
        "pkg/b.py": "thing = 1\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..a import f\nfrom pkg import b\nimport pkg.sub\n",
        "pkg/sub/d.py": "from pkg.sub import c, flag\nfrom . import c as again\n",
    })
    mods, graph = import_graph(root, "pkg")
    assert sorted(mods) == ["pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.d"]
    assert graph["pkg"] == [("pkg.b", 1, False)]
    # a string is no import; a function's import is, and it runs the package on the way
    assert graph["pkg.a"] == [("pkg.b", 2, False), ("pkg.sub", 5, True), ("pkg.sub.c", 5, True)]
    # an enclosing package passed through is not an edge...
    assert graph["pkg.sub.c"] == [("pkg.a", 1, False), ("pkg.b", 2, False)]
    # ...but a name read from its __init__ is
    assert graph["pkg.sub.d"] == [("pkg.sub", 1, False), ("pkg.sub.c", 1, False),
                                  ("pkg.sub.c", 2, False)]
    assert cycles(graph) == [["pkg.a", "pkg.sub.c"]]


def test_the_rules_are_read_and_applied(tmp_path):
    text = ("# Doc\n\n## Layer rules\n\nOne line of syntax.\n\n```layers\n"
            "pkg.a          # top\npkg.sub pkg.b\npkg.sub.c !> pkg.b\n```\n")
    layers, bans = read_rules(text)
    assert layers == [["pkg.a"], ["pkg.sub", "pkg.b"]]
    assert bans == [(["pkg.sub.c"], ["pkg.b"], "pkg.sub.c !> pkg.b")]
    assert layer_of("pkg.sub.c", layers) == 1 and layer_of("pkg.bb", layers) is None
    graph = {"pkg.b": [("pkg.a", 3, True)], "pkg.sub.c": [("pkg.b", 2, False)],
             "pkg.a": [("pkg.sub.c", 1, False)]}
    mods = {m: tmp_path / f"{m}.py" for m in graph}
    found = violations(graph, mods, layers, bans, root=tmp_path)
    assert len(found) == 2
    assert found[0].startswith("pkg.b.py:3: pkg.b imports pkg.a (inside a function): upward")
    assert found[1] == "pkg.sub.c.py:2: pkg.sub.c imports pkg.b: forbidden by `pkg.sub.c !> pkg.b`"


# -- the checks of mpipar


@pytest.fixture(scope="module")
def graph():
    return import_graph()


@pytest.fixture(scope="module")
def rules():
    return read_rules(DOC.read_text())


def test_the_layer_rules_name_every_module_and_nothing_else(graph, rules):
    mods, edges = graph
    layers, bans = rules
    names = [n for layer in layers for n in layer]
    problems = [f"{n} is listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for n in names + [n for s, t, _ in bans for n in s + t]:
        if n not in mods:
            problems.append(f"{n} names no module or package under mpipar/")
    for m in sorted(mods):
        if m != PACKAGE and layer_of(m, layers) is None:
            problems.append(f"{m} is in no layer: add it to the right line")
    if edges[PACKAGE]:
        problems.append("mpipar/__init__.py imports a module of mpipar (it must hold only the "
                        "version: the rules leave the root package out)")
    assert not problems, ("docs/architecture.md, Layer rules:\n  " + "\n  ".join(problems))


def test_no_import_cycles(graph):
    mods, edges = graph
    report = []
    for comp in cycles(edges):
        report.append("cycle: " + " <-> ".join(comp))
        for m in comp:
            for t, line, in_fn in edges[m]:
                if t in comp:
                    report.append(f"    {mods[m].relative_to(ROOT)}:{line}: {m} imports {t}"
                                  + (" (inside a function)" if in_fn else ""))
    assert not report, "import cycles among mpipar modules:\n" + "\n".join(report)


def test_imports_point_down_the_layers(graph, rules):
    mods, edges = graph
    found = violations(edges, mods, *rules)
    assert not found, ("imports that break docs/architecture.md's Layer rules (move the code "
                       "down, or pass it in):\n  " + "\n  ".join(found))
