"""A decode step's rows in order of their cached tokens, longest first (on CUDA, by default).

The decode attention kernel (flash-attn's, and features/triton_attention.py's) runs one program
per request and K/V head, in the batch's order. The GPU holds a few hundred programs at once and
starts the next one wherever one ends. A program's time grows with its request's length, so a
long request whose program happens to start late runs on after the rest are done, while the
GPU idles around it. Launched longest first, the programs left at the end are the short ones:
the scheduling rule "longest processing time first" (Graham, 1969).

Nothing else depends on the order: every row's attention and every row of a matmul are computed
on their own, so the tokens are the same, and they go back to their requests by the step's own
list. Sorting 2,000 rows costs the host some 0.1 ms, while the step before runs on the GPU.

Measured on an H100 80 GB (random 8B weights): flash-attn's kernel at every 37th decode step
of W2, one layer times 32 (.gpujobs/sort_rows.py, kept out of git), 10.52 s of attention in the
order of admission against 10.00 s longest first. Whole W2 runs (tools/bench.py paged --workload
W2, against the commit before, two calls): 16,616 and 16,568 output tokens/s against 16,573,
16,478 and 16,097: under 1%, near the runs' own spread.
"""

import dataclasses

import numpy as np


def longest_first(step):
    """The same decode step (engine/scheduler.py's Step), its requests, rows and positions
    reordered: longest cache first."""
    order = np.argsort(-step.positions, kind="stable")  # a position is the tokens cached before
    return dataclasses.replace(step, requests=[step.requests[i] for i in order],
                               rows=step.rows[order], positions=step.positions[order])
