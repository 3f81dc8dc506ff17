"""The import graph of surojax/ and pallas_kernels/ has no cycle and no import that runs up the layers.

Every .py file is parsed with `ast` (nothing is imported). An edge A -> B is any `import B` / `from B import x`
in A, at module level or inside a function or class:
- a relative import resolves against A's package;
- `from pkg import name` is an edge to `pkg.name` when that is a module of ours, else to `pkg`;
- `import a.b.c` is an edge to `a.b.c` only (the parents' __init__ files that Python runs first are not edges;
  an edge to a package is an edge to its __init__.py, which lists its own imports);
- imports under `if TYPE_CHECKING:` are skipped: they never run, so they can make neither a runtime cycle nor a
  runtime dependency (they are annotations only);
- imports of modules outside the two packages are ignored.

(a) Cycles: every strongly connected component of more than one module fails, naming its modules.
(b) Layers: `LAYERS` below, lowest first. A module may import its own layer and any layer below; an import of a
    higher layer fails. A module's layer is the entry with the longest matching dotted prefix.
(c) Imports inside functions of surojax modules must be on `FUNCTION_IMPORTS_ALLOWED`, each with its reason
    (optional dependencies such as gguf, rich, matplotlib, uvicorn are not surojax modules and are not counted).
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("surojax", "pallas_kernels")

# Lowest first. One line per layer: the module prefixes it holds, and what it is. Same-layer imports are allowed.
# models never import parallel / train / serve, and pallas_kernels never imports surojax (docs/architecture.md).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pallas_kernels",),                                          # kernels: arrays + small specs in, arrays out
    ("surojax.hub", "surojax.compilation_cache", "surojax.wording",  # names -> local files (the Hub); XLA cache;
     "surojax.kernel_settings"),                                  # message phrases; kernel choices (SUROJAX_*)
    ("surojax.config",),                                          # the validated YAML: typed sections and rules
    ("surojax.models", "surojax.data"),                           # architecture; data pipeline (reads DatasetSpec)
    ("surojax.quant", "surojax.parallel", "surojax.generation", "surojax.losses"),  # transforms of / over a model
    ("surojax.weights",),                                         # safetensors / GGUF files <-> parameters
    ("surojax.peft", "surojax.precision"),                        # LoRA + adapter files; fp8 over (LoRA) linears
    ("surojax.offload", "surojax.model_loader"),                  # host placement + layer loops; ref -> a model
    ("surojax.serve",),                                           # serving engine (GRPO will roll out on it)
    ("surojax.train",),                                           # specs -> one assembled run; trainer; tasks
    ("surojax.bench",),                                           # benchmarks built from the train specs
    ("surojax.api", "surojax.cli", "surojax.train.__main__", "surojax"),  # entry points: API, CLI, package root
)

# Imports of surojax modules inside functions, by (importing module, imported module): each says why it is not
# at module level. A new one fails the test; hoist it, or add it here with its reason.
_CLI_RUN = "a command's run() imports what it runs: `surojax COMMAND --help` never imports jax (cli/main.py)"
_CLI_COMMON = "cli/main.py imports cli.common for `--help`, which must import neither pydantic nor jax"
_GGUF = "quant.quantize_mix imports the `gguf` package, which the GPU image lacks; only GGUF writing needs it"
FUNCTION_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    ("surojax", "surojax.api"): "the package root loads the API on first attribute use: `surojax --help` stays fast",
    **{("surojax.cli.common", target): _CLI_COMMON for target in (
        "surojax.config", "surojax.config.stages", "surojax.train.stages", "surojax.train.interrupts",
        "surojax.parallel.distributed", "surojax.train.xla_options")},
    **{(f"surojax.cli.{command}", target): _CLI_RUN for command, targets in {
        "bench": ("surojax.bench.train_bench", "surojax.bench.config_bench",
                  "surojax.models.layers.attention_backend"),
        "distill": ("surojax.config.load", "surojax.train.distill"),
        "grpo": ("surojax.config.load",),
        "grpo_colocate": ("surojax.config.errors", "surojax.config.grpo_colocate", "surojax.config.load"),
        "dpo": ("surojax.config.load", "surojax.config.stages"),
        "export": ("surojax.config.stages", "surojax.train.checkpoints", "surojax.train.trainers"),
        "generate": ("surojax.model_loader", "surojax.generation.loop", "surojax.quant.laid_out",
                     "surojax.data.sources", "surojax.data.vision_data", "surojax.serve.image_prompt"),
        "merge": ("surojax.model_loader", "surojax.peft.stacked", "surojax.weights.gguf_tokenizer",
                  "surojax.weights.hf_checkpoint"),
        "quantize": ("surojax.model_loader", "surojax.weights.gguf_checkpoint", "surojax.weights.gguf_tokenizer",
                     "surojax.weights.model_ref"),
        "serve": ("surojax.serve.launch", "surojax.cli.serve_file"),
        "tokenize": ("surojax.config.stages", "surojax.data.debug", "surojax.hub", "surojax.data.pipeline",
                     "surojax.data.tokenizer"),
    }.items() for target in targets},
    ("surojax.quant.model", "surojax.quant.quantize_mix"): _GGUF,
    ("surojax.bench.quant_base", "surojax.quant.quantize_mix"): _GGUF,
    ("surojax.weights.gguf_checkpoint", "surojax.quant.quantize_mix"): _GGUF,
}


@dataclass(frozen=True)
class Edge:
    """One import statement: `source` imports `target` at `line`; `in_function` when inside a def."""
    source: str
    target: str
    line: int
    in_function: bool


def module_files(root: pathlib.Path, packages: tuple[str, ...]) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under root/<package> (a package is its __init__.py)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """(node, in_function) for every Import / ImportFrom, skipping `if TYPE_CHECKING:` bodies."""
    def walk(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from walk_one(sub, in_function)
                continue
            yield from walk_one(child, in_function)

    def walk_one(node: ast.AST, in_function: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        yield from walk(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    yield from walk(tree, False)


def module_edges(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[Edge]:
    """The edges out of module `name` (file `path`) to modules in `modules`."""
    is_package = path.name == "__init__.py"
    edges = []
    for node, in_function in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                       for alias in node.names]
        for target in dict.fromkeys(targets):
            if target in modules and target != name:
                edges.append(Edge(name, target, node.lineno, in_function))
    return edges


def import_graph(root: pathlib.Path, packages: tuple[str, ...]) -> list[Edge]:
    """Every import edge between the modules of `packages` under `root`."""
    modules = module_files(root, packages)
    return [edge for name, path in modules.items() for edge in module_edges(name, path, modules)]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; sorted by first module."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int:
    """Index in `layers` of the entry whose prefix matches `module` longest (KeyError when none matches)."""
    best, best_len = None, -1
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best is None:
        raise KeyError(f"{module} is in no layer of LAYERS")
    return best


def upward_imports(edges: list[Edge], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """One line per edge whose target sits in a higher layer than its source."""
    return [f"{e.source}:{e.line} imports {e.target} (layer {layer_of(e.source, layers)} -> "
            f"{layer_of(e.target, layers)})" for e in edges if layer_of(e.target, layers) > layer_of(e.source, layers)]


def function_imports(edges: list[Edge], allowed: dict[tuple[str, str], str]) -> list[str]:
    """One line per import inside a function that is not on the allow-list."""
    return [f"{e.source}:{e.line} imports {e.target} inside a function"
            for e in edges if e.in_function and (e.source, e.target) not in allowed]


# -- the real packages ---------------------------------------------------------------------------------------------

EDGES = import_graph(REPO, PACKAGES)


def test_the_graph_is_not_empty():
    sources = {e.source for e in EDGES}
    assert len(module_files(REPO, PACKAGES)) > 100 and {"surojax.train.trainer", "surojax.models.decoder"} <= sources


def test_every_module_has_a_layer():
    for module in module_files(REPO, PACKAGES):
        layer_of(module, LAYERS)


def test_no_import_cycle():
    found = cycles(EDGES)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_upward_import():
    found = upward_imports(EDGES, LAYERS)
    assert not found, "imports up the layers (LAYERS in this file):\n" + "\n".join(found)


def test_no_new_import_inside_a_function():
    found = function_imports(EDGES, FUNCTION_IMPORTS_ALLOWED)
    assert not found, "hoist these to module level, or allow them with a reason:\n" + "\n".join(found)


def test_every_allowed_function_import_still_exists():
    present = {(e.source, e.target) for e in EDGES if e.in_function}
    assert set(FUNCTION_IMPORTS_ALLOWED) <= present, set(FUNCTION_IMPORTS_ALLOWED) - present


# -- the checker finds what it must (a synthetic package) ----------------------------------------------------------

def _write(root: pathlib.Path, files: dict[str, str]):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_reports_a_cycle_an_upward_import_and_a_function_import(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "from . import a\n",
        "pkg/low/a.py": "import os\nfrom pkg.low import b\n",
        "pkg/low/b.py": "from .a import x\n",                                     # a <-> b: a cycle
        "pkg/low/c.py": "def f():\n    from ..high import d\n",                  # upward, inside a function
        "pkg/low/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import d\n",
        "pkg/high/__init__.py": "",
        "pkg/high/d.py": "import pkg.low.a\nfrom pkg import low\n",              # downward: fine
    })
    layers = (("pkg.low", "pkg"), ("pkg.high",))
    edges = import_graph(tmp_path, ("pkg",))
    assert cycles(edges) == [["pkg.low.a", "pkg.low.b"]]
    assert upward_imports(edges, layers) == ["pkg.low.c:2 imports pkg.high.d (layer 0 -> 1)"]
    assert function_imports(edges, {}) == ["pkg.low.c:2 imports pkg.high.d inside a function"]
    assert function_imports(edges, {("pkg.low.c", "pkg.high.d"): "a reason"}) == []
    assert not any(e.source == "pkg.low.t" for e in edges)                        # TYPE_CHECKING is skipped
    assert {e.target for e in edges if e.source == "pkg.high.d"} == {"pkg.low.a", "pkg.low"}
