"""What a step takes: ``scheduler.py`` batches the requests under a token budget (chunked prefill, preemption,
speculative decoding's verifies and their drafts) over ``block_manager.py``'s paged KV blocks (prefix caching);
``step_pacing.py`` keeps a CPU step's budget to a step time; ``stats.py`` counts what the steps did. The runner
reads the scheduled batches and block tables; this package imports nothing that runs a model.
"""
