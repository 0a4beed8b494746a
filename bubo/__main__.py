from bubo.cli import main

raise SystemExit(main())
