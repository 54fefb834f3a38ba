"""The package's imports point one way (runtime.py's docstring): no module imports one of a higher layer, and no
two modules import each other, even through others (imports inside functions included)."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
LAYERS = [["fp8mla.runtime"], ["fp8mla.formats"], ["fp8mla.schedule", "fp8mla.reference", "fp8mla.inputs"],
          ["fp8mla.kernels"], ["fp8mla.checks"], ["fp8mla.api"],
          ["fp8mla.compat", "fp8mla.bench", "fp8mla.demo", "fp8mla.__main__", "fp8mla"]]


def layer(module: str) -> int:
    """The layer of a module (a subpackage's modules are in its layer)."""
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names if n != "fp8mla") or module == "fp8mla":
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def modules() -> dict:
    found = {}
    for path in (SRC / "fp8mla").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known) -> set:
    """The fp8mla modules ``name`` imports (``from X import y`` counts as X.y where that is a module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range((node.level or 1) - 1):
                base = base.rsplit(".", 1)[0]
            mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def test_imports_point_down_the_layers():
    known = modules()
    wrong = [(a, b) for a, path in known.items() for b in imports(a, path, known)
             if layer(b) > layer(a) and not b.startswith(a + ".")]
    assert not wrong, wrong


def test_no_import_cycle():
    known = modules()
    graph = {a: imports(a, path, known) for a, path in known.items()}
    # a package imports its own submodules (re-exports): not a cycle with them
    graph = {a: {b for b in bs if not b.startswith(a + ".")} for a, bs in graph.items()}
    state, stack = {}, []

    def visit(a):
        state[a] = "open"
        stack.append(a)
        for b in graph[a]:
            if state.get(b) == "open":
                raise AssertionError(" -> ".join(stack[stack.index(b):] + [b]))
            if b not in state:
                visit(b)
        stack.pop()
        state[a] = "done"

    for a in sorted(graph):
        if a not in state:
            visit(a)
