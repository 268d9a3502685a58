from trio_llm.cli import main

raise SystemExit(main())
