"""A decode step's rows in order of their cached tokens, longest first (on CUDA, by default).

The decode attention kernel (flash-attn's, and features/triton_attention.py's) runs one program
per request and K/V head, in the batch's order. The GPU holds a few hundred programs at once and
starts the next one wherever one ends. A program's time grows with its request's length, so a
long request whose program happens to start late runs on after the rest are done, while the
GPU idles around it. Launched longest first, the programs left at the end are the short ones:
the scheduling rule "longest processing time first" (Graham, 1969).

More in docs/engine-notes.md.
"""

import dataclasses

import numpy as np


def longest_first(step):
    """The same decode step (engine/scheduler.py's Step), its requests, rows and positions
    reordered: longest cache first."""
    order = np.argsort(-step.positions, kind="stable")  # a position is the tokens cached before
    return dataclasses.replace(step, requests=[step.requests[i] for i in order],
                               rows=step.rows[order], positions=step.positions[order])
