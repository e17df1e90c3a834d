"""The layout the README promises: the lesson reads on its own, imports run one way (no circle,
`__main__` blocks included), and a run executes the files of what it asks for, no others."""

import ast
import os
import subprocess
import sys

import pytest

from conftest import ROOT

LESSON_IMPORTS = {"block_manager", "plumbing.cli", "plumbing.inputs", "plumbing.interrupt"}


def project_modules() -> dict:
    files = [*ROOT.glob("*.py"), *ROOT.glob("engine/*.py"), *ROOT.glob("features/**/*.py"),
             *ROOT.glob("plumbing/*.py"), *ROOT.glob("tools/*.py")]
    return {".".join(f.relative_to(ROOT).with_suffix("").parts): f for f in files}


def imports_of(path, modules: dict, through_seams: bool = True) -> set:
    """Every project module that `path` imports, at any depth of its code: a function's lazy
    import too, and its `__main__` block's (a script hands a feature's command line to the
    engine's program by name, plumbing/cli.py's hand_to_the_engine, importing none of it), and,
    with `through_seams`, a feature's module that it asks engine/seams.py's `plug` for."""
    from engine.seams import FEATURES
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            elif through_seams and plugged(child):
                names = [FEATURES[child.args[0].value].module]
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


def test_the_lesson_imports_the_block_manager_and_three_support_modules_only():
    modules = project_modules()
    assert imports_of(modules["llama3_paged"], modules) == LESSON_IMPORTS
    naive = imports_of(modules["llama3_naive"], modules)
    assert naive - LESSON_IMPORTS == {"llama3_paged"}, "the naive script builds on the lesson alone"
    # The virtual script: the lesson, and its page mapping in one file beside it
    virtual = imports_of(modules["llama3_virtual"], modules) - {"virtual_pages.PageManager",
                                                                "virtual_pages.VirtualMemory"}
    assert virtual - LESSON_IMPORTS == {"llama3_paged", "virtual_pages"}
    pages = imports_of(modules["virtual_pages"], modules)
    assert {m.split(".")[0] for m in pages} <= {"block_manager", "plumbing"}, pages


def test_no_feature_imports_another_feature():
    # A feature is a file of features/ or a folder of it; where two combine, the engine joins
    # them (engine/fp8_virtual_cache.py), so each is read, and run, on its own.
    modules = project_modules()
    feature_of = lambda module: module.split(".")[1]
    across = {name: sorted(m for m in imports_of(path, modules)
                           if m.startswith("features.") and feature_of(m) != feature_of(name))
              for name, path in modules.items() if name.startswith("features.")}
    assert not {name: found for name, found in across.items() if found}


def test_the_lesson_files_stay_short():
    lines = lambda name: len((ROOT / name).read_text().splitlines())
    assert lines("llama3_paged.py") <= 500 and lines("block_manager.py") <= 150
    assert lines("llama3_virtual.py") + lines("virtual_pages.py") <= 300


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
            "--max-new-tokens", "4", *EXTRA_FLAGS]
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


def walk(extra_flags: list[str]) -> list[str]:
    """A CPU run's stderr lines, on a machine without CUDA (none visible): the project's files
    it executed, then what it loaded."""
    settings = f"COMPILER_MODULES = {COMPILER_MODULES!r}; EXTRA_FLAGS = {extra_flags!r}"
    result = subprocess.run([sys.executable, "-c", settings + WALK], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr.splitlines()


@pytest.fixture(scope="module")
def plain_run() -> list[str]:
    return walk([])


def test_a_plain_cpu_run_executes_the_lesson_and_four_files_beside_it(plain_run):
    executed = {line for line in plain_run if line.endswith(".py")}
    assert executed == {"llama3_paged.py", "block_manager.py", "plumbing/interrupt.py",
                        "plumbing/cli.py", "plumbing/inputs.py"}, executed


def test_a_plain_cpu_run_loads_no_compiler(plain_run):
    assert plain_run[-1] == "loaded:", plain_run[-1]


FEATURES_NOT_ASKED_FOR = ("virtual", "mapping", "tensor_parallel", "beam", "cascade", "fp8",
                          "triton")


def test_a_continuous_run_executes_no_file_of_a_feature_it_did_not_ask_for_nor_the_compiler():
    lines = walk(["--continuous"])
    executed = [line for line in lines if line.endswith(".py")]
    assert "engine/scheduler.py" in executed, executed  # the engine's program ran it
    assert not [f for f in executed if any(name in f for name in FEATURES_NOT_ASKED_FOR)], executed
    # Compiled layers run only where CUDA is (engine/kv_cache.py's left_out_of_compiled_layers)
    assert lines[-1] == "loaded:", lines[-1]


LESSON_MODULES = {"llama3_paged", "block_manager", "llama3_naive", "llama3_virtual",
                  "virtual_pages"}


def test_no_class_is_more_than_two_levels_below_a_lesson_class():
    """The engine and the features use the lesson's classes by composition or a level or two of
    subclassing (vLLM's and nano-vllm's depth), not chains. Modules whose GPU-only packages are
    missing here (triton) are left out, and named."""
    import importlib
    import inspect
    is_lesson = lambda c: c.__module__ in LESSON_MODULES
    def below(c) -> int | None:  # levels below the nearest lesson class, or None if none
        if is_lesson(c):
            return 0
        levels = [below(b) for b in c.__bases__]
        return 1 + max(d for d in levels if d is not None) if any(
            d is not None for d in levels) else None
    depths, missing = {}, []
    for name in [n for n in project_modules() if n.split(".")[0] in ("engine", "features",
                                                                     "plumbing", "serve")]:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            assert e.name == "triton", e  # only what the GPU machine has
            missing.append(name)
            continue
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == name and below(cls):
                depths[f"{name}.{cls.__name__}"] = below(cls)
    deepest = sorted(depths.items(), key=lambda item: -item[1])
    assert deepest and deepest[0][1] <= 2, (deepest, "not imported here (no triton):", missing)


LESSON_LOOP_CLASSES = {"Engine", "Scheduler", "Decoder", "Step", "Generation", "KVSnapshot",
                       "Request", "PrefillBatch", "DecodeBatch"}


def test_no_class_of_the_engine_or_a_feature_subclasses_the_lessons_loop():
    """The engine holds the lesson's model, pool and attention (composition, or one level of
    subclassing of those); its loop, requests, steps, batches and outputs are its own, so that a
    change to the lesson's loop cannot change the engine's. Read from the source, so a module
    whose GPU-only packages are missing here is checked too."""
    found = []
    for name, path in project_modules().items():
        if name.split(".")[0] not in ("engine", "features"):
            continue
        tree = ast.parse(path.read_text())
        lesson_names = {}  # a name in this file -> the lesson class it is, or "module"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in LESSON_MODULES:
                lesson_names.update({a.asname or a.name: a.name for a in node.names})
            elif isinstance(node, ast.Import):
                lesson_names.update({a.asname or a.name: "module" for a in node.names
                                     if a.name in LESSON_MODULES})
        for node in ast.walk(tree):
            for base in node.bases if isinstance(node, ast.ClassDef) else ():
                if isinstance(base, ast.Name):
                    lesson_class = lesson_names.get(base.id)
                elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                    lesson_class = base.attr if lesson_names.get(base.value.id) == "module" else None
                else:
                    lesson_class = None
                if lesson_class in LESSON_LOOP_CLASSES:
                    found.append(f"{name}.{node.name}({lesson_class})")
    assert not found, found


def test_every_pass_of_the_engine_carries_one_attention_metadata_object():
    """The model runner builds one AttentionMetadata per pass (engine/attention_metadata.py), and
    the caches ask its phase: no file of engine/ or features/ builds or imports the lesson's
    batch classes, nor tells a batch's kind by isinstance."""
    found = []
    for name, path in project_modules().items():
        if name.split(".")[0] not in ("engine", "features"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in LESSON_MODULES:
                found += [f"{name} imports {a.name}" for a in node.names
                          if a.name in ("PrefillBatch", "DecodeBatch")]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "isinstance" and "Batch" in ast.unparse(node.args[1])):
                found.append(f"{name}: {ast.unparse(node)}")
    assert not found, found


def plugged(node) -> bool:
    """Whether `node` is a call plug("feature", ...) of engine/seams.py."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "plug" and node.args and isinstance(node.args[0], ast.Constant))


def test_the_seam_table_of_the_docs_is_the_engines():
    from engine.seams import FEATURES
    text = (ROOT / "docs" / "layout.md").read_text()
    section = text[text.index("### Seams"):text.index("### Glossary")]
    rows = [[cell.strip(" `") for cell in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == ["feature", "seam", "where"]
    assert rows[1:] == [[name, f.seam, f.module.replace(".", "/") + ".py"]
                        for name, f in FEATURES.items()]


def test_every_file_of_features_belongs_to_a_feature_at_a_seam():
    # Its own row, or its folder's: features/fp8/swiglu_quantize.py is FP8 weights' kernel
    from engine.seams import FEATURES
    declared = {f.module for f in FEATURES.values()}
    folders = {m.rsplit(".", 1)[0] for m in declared if m.count(".") == 2}
    modules = [m for m in project_modules() if m.startswith("features.")]
    assert modules and not [m for m in modules
                            if m not in declared and m.rsplit(".", 1)[0] not in folders]


def test_the_engine_reaches_a_feature_only_through_its_seam():
    # No file outside features/ imports one: the engine asks plug, and every plug it asks for
    # is one the feature declares and defines
    from engine.seams import FEATURES
    modules = project_modules()
    direct = {name: sorted(m for m in imports_of(path, modules, through_seams=False)
                           if m.startswith("features"))
              for name, path in modules.items()
              if not name.startswith(("features.", "tools."))}
    assert not {name: found for name, found in direct.items() if found}
    asked = [(node.args[0].value, node.args[1].value if len(node.args) > 1 else None)
             for name, path in modules.items() if not name.startswith("features.")
             for node in ast.walk(ast.parse(path.read_text())) if plugged(node)]
    assert len(asked) > 20
    for feature, name in asked:
        plugs = FEATURES[feature].plugs
        assert name is None or name in plugs, (feature, name)
    for feature in FEATURES.values():
        tree = ast.parse(modules[feature.module].read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert set(feature.plugs) <= defined, (feature.module, set(feature.plugs) - defined)


def test_what_plugs_into_a_seam_answers_what_the_seam_asks():
    import importlib
    import inspect
    from engine.seams import FEATURES, PROTOCOLS, plug
    checked = []
    for name, feature in FEATURES.items():
        if feature.seam not in PROTOCOLS:
            continue  # a function of the model, the processes or a run: no methods to ask
        try:
            importlib.import_module(feature.module)
        except ImportError:  # Triton's kernels, on a machine without it
            continue
        answer = plug(name)
        if not inspect.isclass(answer):
            continue  # longest first: a function of the step, called where the step launches
        asked = [m for m, value in vars(PROTOCOLS[feature.seam]).items()
                 if inspect.isfunction(value) and (not m.startswith("_") or m == "__call__")]
        missing = [m for m in asked if not callable(getattr(answer, m, None))]
        missing += [a for a in getattr(PROTOCOLS[feature.seam], "__annotations__", {})
                    if not hasattr(answer, a)]  # what it declares of itself
        assert not missing, (name, missing)
        checked.append((name, asked))
    assert len(checked) >= 8, checked


def test_module_docstrings_are_a_paragraph_and_the_code_keeps_no_measurement_diary():
    # What a longer docstring said is in docs/engine-notes.md; figures live in docs/ beside
    # their commands, so no code names a GPU's measurement, a job script or an issue
    import re
    modules = project_modules()
    long = {name: len(ast.get_docstring(ast.parse(path.read_text()), clean=False).splitlines())
            for name, path in modules.items()
            if name.startswith(("engine.", "features.", "plumbing.")) or name == "serve"}
    assert len(long) > 40 and not {name: n for name, n in long.items() if n > 12}
    diary = re.compile(r"\bH[12]00\b(?!'s \d+ SMs)|\.gpujobs|\bissue \d+")
    found = {name: diary.findall(path.read_text()) for name, path in modules.items()
             if not name.startswith(("tools.", "tests."))}
    assert not {name: hits for name, hits in found.items() if hits}
