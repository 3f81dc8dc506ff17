"""pallas_kernels imports nothing from surojax: every `import` / `from ... import` in every .py under it, at module
level and inside functions or classes, is parsed with `ast` (not run) and must not name surojax; nor may a
`__import__(...)` / `importlib.import_module(...)` call with a literal name."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "pallas_kernels"
FILES = sorted(ROOT.rglob("*.py"))


def surojax_imports(source: str) -> list[str]:
    """The imported module names of `source` that are surojax or below it (relative imports resolve inside
    pallas_kernels, so they cannot reach surojax)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names = [node.args[0].value]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n == "surojax" or n.startswith("surojax.")]
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id in ("__import__", "import_module")) or \
        (isinstance(func, ast.Attribute) and func.attr == "import_module")


def test_the_package_has_files():
    assert ROOT / "__init__.py" in FILES and len(FILES) > 1


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_surojax_import(path):
    assert surojax_imports(path.read_text()) == [], path


def test_the_check_finds_imports_anywhere():
    source = ("import os\nimport surojax\nfrom surojax.quant import NF4\n"
              "def f():\n    import surojax.quant.nf4 as m\n    from surojax import quant\n"
              "class C:\n    def g(self):\n        from surojaxx import y\n        from . import z\n"
              "        importlib.import_module('surojax.peft')\n")
    assert surojax_imports(source) == ["line 2: surojax", "line 3: surojax.quant", "line 5: surojax.quant.nf4",
                                       "line 6: surojax", "line 11: surojax.peft"]
