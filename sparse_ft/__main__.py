from sparse_ft.cli import main

raise SystemExit(main())
