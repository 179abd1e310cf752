"""A vLLM-compatible engine simulator: same HTTP API and metrics, a vLLM v1 performance model.

The pure core (``tokenizer``, ``kv_cache``, ``scheduler``, ``perf``, ``faults``) is free of
I/O and deterministic given a seed; ``engine`` runs it in real time on asyncio, ``prom`` keeps
its vLLM metrics, ``server`` speaks vLLM's OpenAI-compatible protocol (generation in
``generation``, its bodies in ``openai_protocol``), ``cli`` hosts several engines in one
process. See ``docs/engine-simulator.md``.
"""
