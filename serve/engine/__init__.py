"""The serving engine: the step loop (engine.py) over the scheduler, the sampler, per-request state and streams,
the tokenizer, and the thread and heap settings the loop runs with."""
