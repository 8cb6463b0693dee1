"""``python -m megatron_acrl.study``: see :mod:`megatron_acrl.study.cli`."""

from megatron_acrl.study.cli import main

raise SystemExit(main())
