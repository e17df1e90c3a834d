"""What the three scripts share: everything except how the KV cache is laid out.

    setup.py            the command line, loading, the memory left for KV, how failures end
    generate.py         the loop: admit, prefill, decode one token per step, retire
    scheduler.py        continuous batching: who waits, who runs, who is preempted
    prefix_cache.py     full blocks found again by their tokens: a shared prefix stored once
    sampling.py         the next token: greedy, or sampled with --temperature and --top-p
    kv_cache.py         the pool of K/V slots, written by slot and read through a block table
    virtual_kv_cache.py llama3_virtual.py's cache: contiguous virtual rows, pages mapped on demand
    page_manager.py     the block manager for those rows: it maps pages instead of writing a table
    virtual_memory.py   CUDA's virtual memory API, each driver call checked
    attention.py        three backends over that pool: PyTorch reference, flash-attn, Triton
    triton_attention.py the Triton paged-decode kernel
    cuda_graphs.py      a decode step recorded once and replayed
    model.py            Llama 3, which knows nothing of the cache layout
    checkpoints.py      Meta's and Hugging Face's weights, or random ones
    tokenizer.py        Llama 3's tokenizer and chat format
    prompts.py          the ShareGPT requests
    report.py           throughput and where the KV memory went
    max_batch.py        --find-max-batch: bisection over real runs
    errors.py           the failures a user can hit, and their exit codes
"""
