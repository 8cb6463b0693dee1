"""``python -m megatron_acrl.config``: validate and print a config, or explain every field."""

from __future__ import annotations

import argparse
import sys

import yaml

from megatron_acrl.config._base import ConfigError
from megatron_acrl.config.loader import config_to_dict, explain, load_config_with_sources


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_acrl.config", description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", help="YAML config to validate and print")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. correction.gamma=0.8")
    ap.add_argument(
        "--explain",
        action="store_true",
        help="print every field with its type, value and doc: the defaults, or with CONFIG its values, "
        "marking those algorithm.name set",
    )
    args = ap.parse_args(argv)
    if args.explain and args.config is None:
        print("\n".join(explain()))
        return 0
    try:
        cfg, sources = load_config_with_sources(args.config, args.overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.explain:
        print("\n".join(explain(cfg, sources)))
    else:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
