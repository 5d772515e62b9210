from perseus_ext.cli import main

raise SystemExit(main())
