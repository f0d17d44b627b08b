"""Benchmarks that drive a running server over HTTP (torch-free).

``serve.py`` is ``deepinfer bench serve`` (vLLM ``bench serve`` flags and metric definitions):
``datasets`` (workloads) → ``arrivals`` (send times) → ``runner`` + ``client`` (streaming
requests) → ``metrics`` → ``economics`` → ``report`` (table, JSON as ``result_schema``
documents it) and ``plots`` (PNGs).
"""
