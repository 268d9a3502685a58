"""The reference fork's stand-in, for the interoperability tests: the code is
``trio_llm.scenario.standin`` (written from ``ARBITER-PROTOCOL.md`` only, with plain
blocking flock and no trio), which the scenario runner's ``fork`` step runs too.

    python tests/standin.py --arena DIR --hold 5
"""

from trio_llm.scenario.standin import main

if __name__ == "__main__":
    raise SystemExit(main())
