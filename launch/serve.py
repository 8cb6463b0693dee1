"""Run one SGLang rollout server in the foreground, as a task of the job script's server step.

    srun --ntasks=4 --ntasks-per-node=2 ... python -m launch.serve run/config.yaml --host 0.0.0.0

Each srun task serves one full copy of the model: its port is ``rollout.base_port + SLURM_LOCALID``
and its GPUs the ``SLURM_LOCALID``-th slice of ``rollout.server_tp`` devices in the step's
``CUDA_VISIBLE_DEVICES``. The API key comes from the environment variable named by
``rollout.api_key_env`` (the job script generates it per job); a server bound beyond loopback
without one is refused (exit 2). The command line and environment come from
:class:`sglang_bridge.server.ServerSpec` (which carries the CPU stand-ins), and the process ``exec``s
SGLang so that SLURM's signals reach it directly.

The key reaches SGLang the way :mod:`sglang_bridge.server_key` describes: a 0600 ``--config`` file,
never the command line, and not the environment either (the variable is dropped). Before the
``exec`` a forked companion takes over the task's output: SGLang writes into a pipe, the companion
copies it to the task's log (``logs/server-<i>.log``) with the key redacted, removes the key file
once the server answers with the key, and exits when the server's last process has closed the pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.plan import DEFAULT_PORT
from megatron_acrl.config import Config, ConfigError, load_config
from megatron_acrl.config.exit_codes import CONFIG_ERROR


@dataclass(frozen=True)
class ServerSlot:
    """Where this task's server lives: its index in the job, bind address, port and devices."""

    index: int
    host: str
    port: int
    gpu_ids: tuple[int, ...] | None


def server_slot(
    cfg: Config, host: str, port: int | None = None, env: dict[str, str] | None = None
) -> ServerSlot:
    """Slot of the server run by this srun task (from SLURM_PROCID / SLURM_LOCALID / CUDA_VISIBLE_DEVICES)."""
    env = dict(os.environ if env is None else env)
    index = int(env.get("SLURM_PROCID", "0"))
    local = int(env.get("SLURM_LOCALID", "0"))
    tp = cfg.rollout.server_tp
    gpu_ids: tuple[int, ...] | None = None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip().isdigit()]
    if len(visible) >= (local + 1) * tp:
        # SLURM gives the step all the node's server GPUs; each server takes its own slice.
        gpu_ids = tuple(int(d) for d in visible[local * tp : (local + 1) * tp])
    return ServerSlot(
        index, host, port if port is not None else (cfg.rollout.base_port or DEFAULT_PORT) + local, gpu_ids
    )


def server_command(
    cfg: Config,
    slot: ServerSlot,
    api_key: str | None,
    run_dir: Path | None = None,
    key_file: str | Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of the SGLang server for ``slot``; with ``api_key``, its
    ``key_file`` (the 0600 ``--config`` file holding the key) is named on the command line.

    With real FP8 rollout (a cuda server, ``rollout.fp8_mode`` auto or real) the server serves the FP8
    copy of ``model.hf_path`` under ``run_dir/served_fp8`` (written by the first task that needs it;
    the trainer reads its weight-sync manifest from the same copy), so its weights are exactly the
    e4m3 + scales the bridge sends."""
    # Imported here so that `launch.submit` (and its tests) never import the SGLang side.
    from megatron_acrl.servers.transfer import fp8_scheme, resolve_fp8_mode
    from sglang_bridge.fp8 import served_fp8_checkpoint
    from sglang_bridge.server import ServerSpec

    if cfg.model.hf_path is None:
        raise ConfigError(
            [("model.hf_path", "a server started by the job script needs an HF checkpoint to serve")]
        )
    device = cfg.rollout.device
    if device == "auto":
        device = "cuda" if slot.gpu_ids or os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
    # FP8 rollouts: a GPU server serves the FP8 checkpoint and the trainer's weight sync sends FP8
    # buckets; on CPU FP8 serving does not exist (shared/docs/research/sglang.md), so the server holds
    # bf16 and the bridge fake-quantizes.
    model_path = cfg.model.hf_path
    scheme = fp8_scheme(cfg)
    if scheme is not None and resolve_fp8_mode(cfg, device) == "real":
        if run_dir is None:
            raise ConfigError([("rollout.fp8_mode", "real FP8 serving needs the run directory")])
        model_path = str(served_fp8_checkpoint(model_path, run_dir / "served_fp8", scheme))
    try:
        spec = ServerSpec(
            model_path=model_path,
            device=device,
            host=slot.host,
            port=slot.port,
            tp=cfg.rollout.server_tp,
            gpu_ids=slot.gpu_ids,
            api_key=api_key,
            random_seed=cfg.training.seed + slot.index,
        )
    except ValueError as e:  # bound beyond loopback without a key
        raise ConfigError([("rollout.api_key_env", f"{e}; the job script exports one per job")]) from e
    env = spec.env()  # from this task's environment, less any variable that holds the key
    # MASTER_ADDR is read from this task's environment: the server's own drops the launcher's variables
    ifname = gloo_interface(device, os.environ)
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return spec.command(slot.port, key_file), env


def gloo_interface(device: str, env: Mapping[str, str]) -> str | None:
    """The interface a CPU server's gloo end of the weight-sync group should bind, or None to leave it.

    gloo binds ``GLOO_SOCKET_IFNAME``, else the address this node's host name resolves to, which on many
    machines is 127.0.0.1 or 127.0.1.1: a server on another node than the trainer then tells the trainer
    to dial its loopback, and the sync never connects. So a CPU server whose trainer is elsewhere
    (``MASTER_ADDR``, exported by the job script, not loopback) binds this node's interface towards it.
    A GPU server (NCCL picks its interfaces itself), a ``GLOO_SOCKET_IFNAME`` the user set, or a trainer
    that cannot be resolved change nothing.
    """
    from sglang_bridge.listeners import address_towards, interface_of, is_loopback

    master = env.get("MASTER_ADDR", "")
    if device != "cpu" or env.get("GLOO_SOCKET_IFNAME") or not master or is_loopback(master):
        return None
    try:
        local = address_towards(f"http://{master}")
    except OSError:  # an unresolvable name or no route: gloo's default, as before
        return None
    # A trainer on this node (its name resolves to loopback) needs nothing either.
    return None if is_loopback(local) else interface_of(local)


def _companion(read_fd: int, api_key: str | None, key_file: Any, url: str) -> None:
    """The forked companion of the server task (see module doc); never returns."""
    from sglang_bridge.server import probe
    from sglang_bridge.server_key import Redactor

    # SLURM signals the whole task; the companion outlives the server's shutdown to log it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    done = threading.Event()

    def remove_key_once_up() -> None:
        while key_file is not None and not done.is_set():
            if probe(url, api_key)[0]:  # SGLang has read its arguments long before it answers
                break
            time.sleep(1.0)
        if key_file is not None:
            key_file.remove()

    threading.Thread(target=remove_key_once_up, daemon=True).start()
    redactor = Redactor([api_key or ""])
    with contextlib.suppress(OSError):
        while chunk := os.read(read_fd, 65536):
            os.write(1, redactor.feed(chunk))
        os.write(1, redactor.flush())
    done.set()
    if key_file is not None:
        key_file.remove()
    os._exit(0)


def exec_server(cmd: list[str], env: dict[str, str], api_key: str | None, key_file: Any, url: str) -> None:
    """Fork the companion that redacts the output and removes ``key_file``, then become SGLang."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        os.close(write_fd)
        _companion(read_fd, api_key, key_file, url)
    os.close(read_fd)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    os.execvpe(cmd[0], cmd, env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.serve", description=__doc__.split("\n")[0])
    ap.add_argument("config", help="resolved config written by launch.submit")
    ap.add_argument("overrides", nargs="*", help="dotted overrides")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for multi-node jobs)")
    ap.add_argument("--port", type=int, default=None, help="port; default rollout.base_port + SLURM_LOCALID")
    ap.add_argument("--print", action="store_true", help="print the command instead of running it")
    args = ap.parse_args(argv)
    os.umask(0o077)  # what the server writes is the job owner's alone
    from sglang_bridge.server_key import KeyFile

    try:
        cfg = load_config(args.config, args.overrides)
        slot = server_slot(cfg, args.host, args.port)
        key_env = cfg.rollout.api_key_env
        api_key = os.environ.get(key_env) if key_env else None
        if key_env and not api_key:
            raise ConfigError([("rollout.api_key_env", f"environment variable {key_env} is not set")])
        key_file = KeyFile(api_key) if api_key else None
        # The job's config is written into its run directory (launch.submit), where the trainer
        # also runs.
        cmd, env = server_command(
            cfg, slot, api_key, Path(args.config).resolve().parent, "<key file>" if api_key else None
        )
    except ConfigError as err:
        print(err, file=sys.stderr)
        return CONFIG_ERROR
    print(
        f"[serve] server {slot.index} on {slot.host}:{slot.port} gpus={slot.gpu_ids}"
        + (f" gloo={env['GLOO_SOCKET_IFNAME']}" if env.get("GLOO_SOCKET_IFNAME") else "")
        + f": {' '.join(cmd)}",
        flush=True,
    )
    if args.print:
        return 0
    if key_file is not None:
        cmd[cmd.index("<key file>")] = str(key_file.write())
    host = "127.0.0.1" if slot.host in ("0.0.0.0", "::", "") else slot.host
    exec_server(cmd, env, api_key, key_file, f"http://{host}:{slot.port}")
    return 1  # pragma: no cover - exec does not return


if __name__ == "__main__":
    raise SystemExit(main())
