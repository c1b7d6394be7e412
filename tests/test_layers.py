"""One direction: the library never imports the research package (it reaches the research
commands and the simulated caches only through entry points, as it would any package's)."""
import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent.parent / "kvquant"


def _imports(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
              and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr))):
            yield ast.unparse(node.args[0])


def test_the_library_imports_nothing_from_the_research_package():
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 40   # the walk found the library
    offenders = {str(p.relative_to(LIBRARY)): name for p in files for name in _imports(p)
                 if "kvquant_experiments" in name or name.startswith("experiments")}
    assert offenders == {}
