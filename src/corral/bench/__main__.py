"""`python -m corral.bench ...`: the same as `corral bench ...`."""

from corral.bench import main

raise SystemExit(main())
