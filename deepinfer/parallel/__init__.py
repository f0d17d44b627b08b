"""Ranks in lock-step: the process group (``group.py``) and the per-step agreement
(``lockstep.py``). Expert-parallel dispatch/combine is an MoE backend
(``ops/moe/expert_parallel.py``); the offline API's rank processes are ``llm/ranks.py``."""
