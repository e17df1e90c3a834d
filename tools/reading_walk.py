"""The files a reader walks through to follow one engine run, and how often the walk goes back.

    python tools/reading_walk.py script        # engine/build.py's generate: a script's run
    python tools/reading_walk.py llm --tree    # engine/llm.py's LLM.generate, with the call tree

Runs a tiny random model on the CPU (random weights: nonsense text) and records each project
function the first time it is called, under the function that first called it. Read depth
first, each function once, that tree is the order a reader meets the code. The walk is that
order's files; a stay is a run of functions in one file, and a return is a stay in a file the
walk has already left. An engine whose every file is read once, in order, has no returns.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plumbing.cli import HelpFormatter, first_paragraph  # noqa: E402

TINY = ["--model", "tiny", "--random-weights", "--device", "cpu", "--max-new-tokens", "4"]


class FirstCalls:
    """A profile hook: each project function's first call, under the project function that
    made it (tests, tools and installed packages are not the project)."""

    def __init__(self):
        self.children, self.seen, self.stack = {None: []}, set(), []

    def __call__(self, frame, event, arg) -> None:
        if event == "return" and self.stack:
            self.stack.pop()
        if event != "call":
            return
        code = frame.f_code
        path = Path(code.co_filename)
        project = (path.is_relative_to(ROOT)
                   and not {"tests", "tools", ".venv"} & set(path.relative_to(ROOT).parts))
        key = (str(path.relative_to(ROOT)), code.co_name, code.co_firstlineno) if project else None
        if key and key not in self.seen:
            caller = next((k for k in reversed(self.stack) if k), None)
            self.seen.add(key)
            self.children.setdefault(caller, []).append(key)
        self.stack.append(key)

    def depth_first(self, key=None, depth: int = 0):
        """(depth, (file, function, line)) in the order a reader meets them."""
        for child in self.children.get(key, []):
            yield depth, child
            yield from self.depth_first(child, depth + 1)


def stays(files: list[str]) -> list[str]:
    """Runs of one file collapsed: [a, a, b, a] -> [a, b, a]."""
    return [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]


def returns(walk: list[str]) -> int:
    """Stays in a file the walk had already left."""
    return len(walk) - len(set(walk))


def traced(run) -> FirstCalls:
    calls = FirstCalls()
    sys.setprofile(calls)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def script_run():
    """llama3_paged.py 3 --continuous on the tiny model: loaded first, then generate traced."""
    from engine.build import allocate_kv_cache, generate
    from engine.config import parse_script_arguments
    from engine.loader import load
    run = load(parse_script_arguments("paged", ["3", "--continuous", *TINY]))
    cache, manager = allocate_kv_cache(run)
    return lambda: generate(run, cache, manager, progress=False)


def llm_run():
    """LLM(...).generate of two prompts, greedy, on the tiny model: built first, then traced."""
    from engine.llm import LLM, SamplingParams
    llm = LLM(model="tiny", random_weights=True, device="cpu", max_num_seqs=4)
    return lambda: llm.generate(["Hello there", "A B C"], SamplingParams(max_tokens=4),
                                use_tqdm=False)


def main() -> None:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("run", choices=["script", "llm"], help="which engine run to follow")
    p.add_argument("--tree", action="store_true", help="print the first-call tree too")
    a = p.parse_args()
    calls = traced(script_run() if a.run == "script" else llm_run())
    order = list(calls.depth_first())
    if a.tree:
        for depth, (file, function, _) in order:
            print(f"{'  ' * depth}{file}: {function}")
    walk = stays([file for _, (file, _, _) in order])
    print(" -> ".join(walk))
    print(f"{a.run}: {len(order)} functions; {len(walk)} stays in {len(set(walk))} files; "
          f"{returns(walk)} returns to a file already left")


if __name__ == "__main__":
    main()
