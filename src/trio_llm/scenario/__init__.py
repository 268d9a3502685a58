"""Scripted contention scenarios: real ``trio-llm serve`` processes sharing one arena,
driven over HTTP, checked and reported (``trio-llm scenario``; see docs/scenarios.md).

Modules, top to bottom: ``runner`` (processes, script, command line) → ``servers``
(one server process and its connection pool), ``client`` (plain and streamed
requests) → ``report`` (figures, checks, report files) → ``record`` (what a run
recorded) → ``format`` (scenario files). Nothing here imports the server.
"""
