from proxy.app.cli import main

raise SystemExit(main())
