from .rank import main

raise SystemExit(main())
