"""--beam-width K: run features/beam_search.py over the first N prompts and report the beams and
the KV memory that sharing saved."""

from plumbing.cli import UserError, format_bytes
from plumbing.report import write_json
from plumbing.setup import make_decoder, make_requests

PAPER = "the paper measures 44.3%-66.3% for beam search on ShareGPT, 37.6%-55.2% on Alpaca"


def check_arguments(args) -> None:
    if args.continuous or args.samples > 1 or args.temperature > 0 or args.find_max_batch:
        raise UserError("--beam-width runs its own static search, greedy by summed "
                        "log-probabilities: it does not combine with --continuous, --samples, "
                        "--temperature or --find-max-batch. Drop those flags.")


def run_beam_search(setup, cache, manager) -> None:
    from core.engine import Engine
    from features.beam_search import BeamSampler, beam_search
    args, width = setup.args, setup.args.beam_width
    sampler = BeamSampler(width)
    decoder = make_decoder(setup, cache, manager, sampler, len(setup.prompts) * width, True)
    engine = Engine(setup.model, cache, manager, sampler, decoder)
    budgets = [r.max_new_tokens for r in make_requests(setup)]  # random weights: reply lengths
    stop_ids = set() if args.random_weights else setup.tokenizer.stop_ids
    result = beam_search(engine, [p.prompt_tokens for p in setup.prompts], width, budgets,
                         stop_ids)
    first = result.prompts[0]
    print(f"\n--- request {setup.prompts[0].id}, its {width} beams, best first ---\n"
          f"> {setup.prompts[0].prompt.strip()[:300]}")
    for score, tokens in first.finished:
        print(f"[{score:.2f}] {setup.tokenizer.decode(tokens)[:300]}")
    token_bytes = setup.kv_bytes_per_token
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
