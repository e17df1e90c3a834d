"""Beam search (--beam-width K): the PagedAttention paper's richest case of block sharing (4.4).

Each prompt keeps K beams, the K likeliest continuations found so far, scored by the sum of their
tokens' log-probabilities. Each step every beam proposes its likeliest next tokens, and the K
best of all K x vocabulary continuations become the next beams: a good beam may leave two
children, a weak one none. So a beam's history is its parent's plus one token, and with
SharingBlockManager (features/sharing/block_manager.py) a child simply takes its parent's blocks:
every block gains or loses holders at every step, and a block no beam holds any more returns to the
pool. The last, part-full block is copied on write when two children both write into it. Without
sharing (--no-sharing) each beam holds its own blocks, and a child's are copied from its parent.

More in docs/engine-notes.md.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from block_manager import to_device
from engine.scheduler import Step
from engine.request import EngineRequest
from plumbing.cli import format_bytes, torchrun_process, write_json


class BeamSampler:
    """Each row's 2K likeliest next tokens with their log-probabilities, [B, 2, 2K] float32:
    [:, 0] the log-probabilities, [:, 1] the token ids (exact in float32 below 2^24). One tensor,
    so that the step's one copy to the host brings both. 2K, not K: the best K continuations of a
    prompt that do not stop are among them even if K of them stop."""

    def __init__(self, width: int):
        self.num_candidates = 2 * width

    def __call__(self, logits, rows, positions) -> torch.Tensor:
        top, ids = torch.log_softmax(logits.float(), dim=-1).topk(self.num_candidates, dim=-1)
        return torch.stack([top, ids.float()], dim=1)


@dataclass
class Prompt:
    """One prompt's search: its K rows of the block table, and beams running and finished."""

    prompt_tokens: list[int]
    rows: np.ndarray  # [K]: beam i runs in rows[i]
    max_new_tokens: int
    running: list[list[int]] = field(default_factory=list)  # each beam's generated tokens
    scores: np.ndarray | None = None  # [K] float32: each running beam's summed log-probabilities
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # best first
    done: bool = False


def choose(prompt: Prompt, candidates: np.ndarray, stop_ids, length_penalty: float) -> np.ndarray:
    """One step of the search for one prompt. candidates: [K, 2, 2K] from BeamSampler. Updates
    the beams and returns [K] the parent of each new running beam (indices into rows)."""
    width = len(prompt.rows)
    log_probs, ids = candidates[:, 0], candidates[:, 1].astype(np.int64)  # [K, 2K] each
    total = (prompt.scores[:, None] + log_probs).ravel()  # [K * 2K] float32
    best = np.argsort(-total, kind="stable")[:2 * width]  # the 2K best continuations, best first
    parents, tokens, scores = best // (2 * width), ids.ravel()[best], total[best]
    generated = len(prompt.running[0]) + 1  # tokens each continuation has
    stops = np.isin(tokens, list(stop_ids)) | (generated >= prompt.max_new_tokens)
    for c in np.flatnonzero(stops[:width]):  # a stopping candidate among the top K finishes
        ending = [] if tokens[c] in stop_ids else [int(tokens[c])]
        prompt.finished.append((float(scores[c]) / generated ** length_penalty,
                                prompt.running[parents[c]] + ending))
    prompt.finished = sorted(prompt.finished, key=lambda f: -f[0])[:width]  # stable: older first
    going_on = np.flatnonzero(~stops)[:width]
    if len(going_on) < width:  # every continuation stops: the length limit
        prompt.done = True
        return parents[:width]
    prompt.running = [prompt.running[parents[c]] + [int(tokens[c])] for c in going_on]
    prompt.scores = scores[going_on]
    worst_finished = prompt.finished[-1][0] if len(prompt.finished) == width else -np.inf
    prompt.done = prompt.scores[0] / generated ** length_penalty <= worst_finished
    return parents[going_on]


def take_parents_blocks(manager, cache, rows: np.ndarray, parents: np.ndarray,
                        shares: bool) -> None:
    """Beam i (row rows[i]) continues beam parents[i]: its cache becomes its parent's. Shared,
    it takes references to the parent's blocks; unshared, the parent's blocks are copied into
    its own. All beams of a prompt hold the same number of tokens."""
    moves = [(row, rows[p]) for row, p in zip(rows.tolist(), parents.tolist()) if rows[p] != row]
    if not moves:
        return
    if shares:
        return manager.take_blocks_of([row for row, _ in moves], [parent for _, parent in moves])
    shape = (cache.k.shape[0], *cache.block_shape)  # [n_layers, num_blocks, block_size, H, D]
    sources = [b for _, parent in moves for b in manager.owned_blocks[parent]]
    destinations = [b for row, _ in moves for b in manager.owned_blocks[row]]
    for pool in (cache.k, cache.v):  # gathered first: beams may swap places
        blocks = pool[:, :cache.num_slots].view(shape)
        blocks[:, destinations] = blocks[:, sources]


@dataclass
class BeamResult:
    prompts: list[Prompt]
    fullest_reserved_slots: int  # the most slots held at any step
    fullest_unshared_slots: int  # the most the beams would have held at any step, unshared
    decode_steps: int
    num_copied_blocks: int = 0


@torch.inference_mode()  # as Engine.generate: the mode CUDA graphs and compiled layers were made in
def beam_search(engine, prompts: list[list[int]], width: int, max_new_tokens: list[int],
                stop_ids=frozenset(), length_penalty: float = 0.0, progress=True,
                shares: bool = False) -> BeamResult:
    """Search K = width beams for each prompt, all prompts in one batch (static: every prompt's
    blocks are taken at the start). Prompt p's beams run in rows p*K .. p*K + K-1; engine's
    sampler must be BeamSampler(width). shares: the engine's block manager shares blocks
    (features/sharing/block_manager.py's)."""
    manager, cache = engine.manager, engine.cache
    searches = [Prompt(p, np.arange(i * width, (i + 1) * width), n)
                for i, (p, n) in enumerate(zip(prompts, max_new_tokens))]
    # Prefill each prompt once, in its first beam's row; without sharing the others get blocks of
    # their own now, which the first step fills with copies.
    firsts = [EngineRequest(int(s.rows[0]), s.prompt_tokens, s.max_new_tokens) for s in searches]
    cached = [manager.allocate(r) for r in firsts]
    # A prompt another prompt holds already is forked: it shares every token's blocks but the
    # last. That one it computes itself, so it first takes a slot of its own (copy on write).
    forks = np.array([r.row for r in firsts if manager.num_tokens[r.row] < len(r.prompt_tokens)],
                     dtype=np.int64)
    manager.append_token(forks)
    if not shares:
        for s in searches:
            for row in s.rows[1:]:
                manager.allocate(EngineRequest(int(row), s.prompt_tokens, s.max_new_tokens))
    step = Step("prefill", firsts, np.array([r.row for r in firsts]), num_cached=np.array(cached))
    candidates = engine.prefill(step).cpu().numpy()  # [N, 2, 2K]
    last_tokens = np.zeros(len(searches) * width, dtype=np.int64)  # each row's next input token
    for s, c in zip(searches, candidates):
        s.running, s.scores = [[]], np.zeros(1, dtype=np.float32)  # one beam, all K to come
        advance(manager, cache, s, c[None], stop_ids, length_penalty, last_tokens, shares)
    fullest, steps = (0, 0), 0
    with tqdm(desc="beam search", unit="step", total=max(max_new_tokens) - 1,
              disable=not progress, leave=False) as bar:
        while live := [s for s in searches if not s.done]:
            rows = np.concatenate([s.rows for s in live])  # [B] = K per live prompt
            positions = manager.num_tokens[rows].copy()
            manager.append_token(rows)  # copy on write where children share a part-full block
            unshared = manager.num_unshared_slots if shares else manager.num_reserved_slots
            fullest = (max(fullest[0], manager.num_reserved_slots), max(fullest[1], unshared))
            slots = manager.slots(rows, positions)
            tokens = to_device(last_tokens[rows], engine.device)
            out = engine.decode_rows(tokens, positions, rows, slots).cpu().numpy()
            for i, s in enumerate(live):
                advance(manager, cache, s, out[i * width:(i + 1) * width], stop_ids,
                        length_penalty, last_tokens, shares)
            steps += 1
            bar.update()
    return BeamResult(searches, *fullest, steps, manager.num_copied if shares else 0)


def advance(manager, cache, search: Prompt, candidates, stop_ids, length_penalty,
            last_tokens, shares: bool) -> None:
    """Choose the prompt's next beams, give each its parent's cache and its last token; free
    the prompt's rows when it is done."""
    parents = choose(search, candidates, stop_ids, length_penalty)
    if search.done:
        for row in search.rows.tolist():
            if row in manager.owned_blocks:
                manager.free(EngineRequest(row, search.prompt_tokens, 0))
        return
    if len(candidates) == 1:  # after the prefill: every beam descends from the first row
        parents = np.zeros(len(search.rows), dtype=np.int64)
    take_parents_blocks(manager, cache, search.rows, parents, shares)
    last_tokens[search.rows] = [beam[-1] for beam in search.running]


PAPER = "the paper measures 44.3%-66.3% for beam search on ShareGPT, 37.6%-55.2% on Alpaca"


def search_and_report(run, engine, budgets: list[int], shares: bool) -> None:
    """--beam-width K (engine/build.py builds the runner as the flags choose, and engine/run.py
    the budgets): the search over the first N prompts, its best beams, and the KV memory that
    sharing saved. shares: the block manager shares blocks."""
    args, width = run.args, run.args.beam_width
    stop_ids = set() if args.random_weights else run.tokenizer.stop_ids
    result = beam_search(engine, [p.prompt_tokens for p in run.prompts], width, budgets,
                         stop_ids, shares=shares)
    first = result.prompts[0]
    print(f"\n--- request {run.prompts[0].id}, its {width} beams, best first ---\n"
          f"> {run.prompts[0].prompt.strip()[:300]}")
    for score, tokens in first.finished:
        print(f"[{score:.2f}] {run.tokenizer.decode(tokens)[:300]}")
    _, processes = torchrun_process() or (0, 1)
    token_bytes = run.kv_bytes_per_token * processes  # under torchrun each holds 1 / processes
    held = result.fullest_reserved_slots * token_bytes
    unshared = result.fullest_unshared_slots * token_bytes
    print(f"\nBeam search: {len(result.prompts):,} prompts x {width} beams, "
          f"{result.decode_steps:,} decode steps.")
    if args.no_sharing:
        print(f"KV memory at the fullest step: {format_bytes(held)}, every beam holding blocks "
              f"of its own (--no-sharing).")
    else:
        print(f"KV memory at the fullest step: {format_bytes(held)} with beams sharing blocks, "
              f"against {format_bytes(unshared)} if each held its own (--no-sharing): "
              f"{100 * (1 - held / unshared):.1f}% saved ({PAPER}); "
              f"{result.num_copied_blocks:,} blocks copied on write.")
    if args.json:
        write_json(args, {"script": "llama3_paged.py --beam-width", "beams": [
            [{"score": s, "output_tokens": t} for s, t in p.finished] for p in result.prompts],
            "memory": {"fullest_reserved_bytes": held, "fullest_unshared_bytes": unshared,
                       "copied_blocks": result.num_copied_blocks},
            "decode_steps": result.decode_steps})
