from tokenprobe.agent.cli import main

raise SystemExit(main())
