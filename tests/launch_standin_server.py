"""Stand-in rollout server for the SLURM launch tests: ``launch.serve``'s CLI, a tiny HTTP server.

Answers ``GET /model_info`` (and ``/health``) like SGLang, demanding the bearer key from
``rollout.api_key_env`` when one is configured. STANDIN_SERVER_MODE=crash exits at once, =hang never
listens (the job script's wait must then name this server).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from launch.serve import server_slot
from megatron_acrl.config import load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    slot = server_slot(cfg, args.host, args.port)
    key_env = cfg.rollout.api_key_env
    key = os.environ.get(key_env) if key_env else None
    mode = os.environ.get("STANDIN_SERVER_MODE", "ok")
    print(
        f"stand-in server {slot.index} on {slot.host}:{slot.port} mode={mode} key={'yes' if key else 'no'}",
        flush=True,
    )
    if mode == "crash":
        print(f"stand-in server {slot.index}: injected start-up crash", file=sys.stderr, flush=True)
        return 1
    if mode == "hang":
        time.sleep(3600)
        return 1

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server naming
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self.send_response(401)
                self.end_headers()
                return
            body = json.dumps({"model_path": cfg.model.hf_path, "server": slot.index}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    ThreadingHTTPServer((slot.host, slot.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
