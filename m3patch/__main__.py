from m3patch.main import main

raise SystemExit(main())
