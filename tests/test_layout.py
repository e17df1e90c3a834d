"""The layout the README promises: the lesson reads on its own, and no module imports in a circle."""

import ast
import subprocess
import sys

import pytest

from conftest import ROOT

LESSON_IMPORTS = {"block_manager", "plumbing.cli", "plumbing.inputs"}


def project_modules() -> dict:
    files = [*ROOT.glob("*.py"), *ROOT.glob("features/*.py"), *ROOT.glob("plumbing/*.py"),
             *ROOT.glob("tools/*.py")]
    return {".".join(f.relative_to(ROOT).with_suffix("").parts): f for f in files}


def is_main_block(node) -> bool:
    """`if __name__ == "__main__":`: what the file runs as a program, not what the module is."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__")


def imports_of(path, modules: dict) -> set:
    """Every project module that `path` imports, at any depth of its code (a function's lazy
    import too), but in its `__main__` block."""
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if is_main_block(child):
                continue
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            found.update(n for n in names if n in modules)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_no_module_imports_in_a_circle():
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    circles, done = [], set()

    def walk(name, path):
        if name in path:
            circles.append(path[path.index(name):] + [name])
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            walk(imported, path + [name])
        done.add(name)

    for name in sorted(graph):
        walk(name, [])
    assert not circles, circles


def test_the_lesson_imports_the_block_manager_and_two_support_modules_only():
    modules = project_modules()
    assert imports_of(modules["llama3_paged"], modules) == LESSON_IMPORTS
    naive = imports_of(modules["llama3_naive"], modules)
    assert naive - LESSON_IMPORTS == {"llama3_paged"}, "the naive script builds on the lesson alone"


WALK = """
import os, runpy, sys
seen, checked = [], set()
def hook(frame, event, arg):
    if event != "call" or frame.f_code in checked:  # each function once: torch calls many
        return
    checked.add(frame.f_code)
    name = os.path.abspath(frame.f_code.co_filename)
    here = os.path.relpath(name) if name.startswith(os.getcwd()) and os.path.isfile(name) else None
    if here and not here.startswith(".") and here not in seen:
        seen.append(here)  # the project's own files, not a virtual environment inside it
sys.argv = ["llama3_paged.py", "3", "--random-weights", "--model", "tiny", "--device", "cpu",
            "--max-new-tokens", "4"]
sys.path.insert(0, os.getcwd())
sys.setprofile(hook)
try:
    runpy.run_path("llama3_paged.py", run_name="__main__")
finally:
    sys.setprofile(None)
    print("\\n".join(seen), file=sys.stderr)
    print("loaded:", *(m for m in COMPILER_MODULES if m in sys.modules), file=sys.stderr)
"""
# What an eager CPU run has no use for, and once spent 1.2 s of its 3 s start-up importing:
# building the model on "meta" ran nn.Embedding's normal_ there (torch._dynamo) and to_empty's
# empty_like (symbolic shapes); plumbing/inputs.py's build_model now does neither.
COMPILER_MODULES = ["torch._dynamo", "torch.fx.experimental.symbolic_shapes"]


@pytest.fixture(scope="module")
def plain_run() -> list[str]:
    """A plain CPU run's stderr lines: the project's files it executed, then what it loaded."""
    result = subprocess.run([sys.executable, "-c", f"COMPILER_MODULES = {COMPILER_MODULES!r}" + WALK],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr.splitlines()


def test_a_plain_cpu_run_executes_the_lesson_and_four_files_beside_it(plain_run):
    executed = {line for line in plain_run if line.endswith(".py")}
    assert executed == {"llama3_paged.py", "block_manager.py", "plumbing/interrupt.py",
                        "plumbing/cli.py", "plumbing/inputs.py"}, executed


def test_a_plain_cpu_run_loads_no_compiler(plain_run):
    assert plain_run[-1] == "loaded:", plain_run[-1]
