from epochfs.cli import main

raise SystemExit(main())
