"""Layering: mpi4py is imported only inside mpipar/mpi/ ("One place talks MPI" in
docs/architecture.md).

Scans every .py file under mpipar/, experiments/ and tests/ with the parser (a mention in a
string or comment is not an import). tests/mpi/ is skipped: those files are the drivers mpiexec
runs, and they may use mpi4py directly to set up a world the way a user's script would.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = ROOT / "mpipar" / "mpi"
SKIPPED = ROOT / "tests" / "mpi"


def mpi4py_imports(path: Path) -> list[int]:
    """Line numbers of the statements in ``path`` that import mpi4py (or a module inside it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n == "mpi4py" or n.startswith("mpi4py.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scanner_sees_imports(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("'from mpi4py import MPI'\nimport os\nif os:\n    from mpi4py import MPI\n"
                 "import mpi4py.util\n")
    assert mpi4py_imports(f) == [4, 5]


def test_mpi4py_only_in_the_mpi_layer():
    offenders = []
    for top in ("mpipar", "experiments", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if ALLOWED in path.parents or SKIPPED in path.parents:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n in mpi4py_imports(path)]
    assert not offenders, (
        "mpi4py imported outside mpipar/mpi/ (move the MPI work into mpipar/mpi/):\n  "
        + "\n  ".join(offenders)
    )
