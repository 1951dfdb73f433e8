from ..rank.launcher_contract import quiet_interrupt_while_starting

quiet_interrupt_while_starting()  # before torch loads, which takes seconds

from .rank import main  # noqa: E402

raise SystemExit(main())
