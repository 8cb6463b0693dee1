"""Launch CPU tier without SLURM: node layout, rendered job script, server wait, exit-code table."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch.plan import DEFAULT_API_KEY_ENV, plan_job
from launch.submit import main as submit_main
from megatron_acrl.config import ConfigError, exit_codes, load_config
from megatron_acrl.warmstart.tiny_model import build_tokenizer
from sglang_bridge.server import ServersNotReady, wait_for_servers

ROOT = Path(__file__).resolve().parents[1]
QWEN7B = ROOT / "configs" / "qwen2.5-7b-gsm8k.yaml"  # tp 4, 4 servers x server_tp 2
TINY = ROOT / "configs" / "tiny_dense.yaml"


@pytest.mark.parametrize(
    ("nodes", "trainer_nodes", "server_nodes", "world"),
    [(2, 1, 1, 8), (3, 2, 1, 16), (5, 4, 1, 32)],
)
def test_gpu_split_dedicated_server_nodes(nodes, trainer_nodes, server_nodes, world):
    cfg = load_config(QWEN7B)
    plan = plan_job(cfg, nodes=nodes, gpus_per_node=8)
    assert (plan.trainer_nodes, plan.server_nodes, plan.world_size) == (trainer_nodes, server_nodes, world)
    assert plan.server_mode == "dedicated" and plan.servers_per_node == 4 and plan.ranks_per_node == 8
    # Servers on other nodes listen beyond loopback, so they get a per-job key.
    assert plan.server_host == "0.0.0.0" and plan.api_key_env == DEFAULT_API_KEY_ENV


def test_gpu_split_more_servers_than_fit_one_node():
    cfg = load_config(QWEN7B, ["rollout.num_servers=6", "rollout.server_tp=4"])
    plan = plan_job(cfg, nodes=5, gpus_per_node=8)
    assert (plan.server_nodes, plan.servers_per_node, plan.trainer_nodes, plan.world_size) == (3, 2, 2, 16)


def test_single_gpu_node_colocates_servers_on_loopback():
    cfg = load_config(QWEN7B, ["rollout.num_servers=2"])
    plan = plan_job(cfg, nodes=1, gpus_per_node=8)
    assert plan.server_mode == "colocated" and plan.ranks_per_node == 4 and plan.world_size == 4
    # On loopback too: the job's servers are keyed (a run owns what it starts).
    assert plan.server_host == "127.0.0.1" and plan.api_key_env == DEFAULT_API_KEY_ENV
    assert plan.server_gpus_per_node == 4 and plan.trainer_gpus_per_node == 4


def test_cpu_single_node_driver_starts_its_own_server():
    plan = plan_job(load_config(TINY), nodes=1, gpus_per_node=0, ranks_per_node=2)
    assert plan.server_mode == "driver" and plan.world_size == 2 and plan.api_key_env is None


def test_cpu_single_node_driver_may_bind_its_servers():
    cfg = load_config(TINY, ["rollout.server_cpus=[1]"])
    assert plan_job(cfg, nodes=1, gpus_per_node=0, ranks_per_node=1).server_mode == "driver"
    with pytest.raises(ConfigError, match="gets its CPUs from SLURM"):
        plan_job(cfg, nodes=1, gpus_per_node=0, ranks_per_node=1, servers_in_job=True)


def test_cpu_multi_node_dedicated():
    cfg = load_config(TINY, ["rollout.num_servers=2", "model.hf_path=/x"])
    plan = plan_job(cfg, nodes=3, gpus_per_node=0, ranks_per_node=2)
    assert (plan.trainer_nodes, plan.server_nodes, plan.world_size, plan.server_mode) == (
        1,
        2,
        2,
        "dedicated",
    )


@pytest.mark.parametrize(
    ("overrides", "nodes", "gpus", "message"),
    [
        (["rollout.server_tp=16"], 2, 8, "does not fit on a node with 8 GPUs"),
        ([], 1, 8, "use all 8 GPUs of the node"),
        (["rollout.num_servers=16"], 2, 8, "leaves no node for the trainer"),
        (["parallel.world_size=16"], 2, 8, "config asks for 16 trainer ranks but the job has 8"),
        (["parallel.dp=3"], 2, 8, "set parallel.dp=2"),
        (["parallel.pp=7"], 2, 8, "use a multiple of tp*pp=28"),
        (["model.hf_path=null"], 2, 8, "model.hf_path"),
        (["rollout.server_urls=[http://a:1]", "rollout.api_key_env=K"], 2, 8, "filled in by the job script"),
        (["rollout.server_cpus=[0,1,2,3]"], 2, 8, "gets its CPUs from SLURM"),
        (["rollout.server_cpus=[0,1,2,3]"], 1, 8, "gets its CPUs from SLURM"),
    ],
)
def test_bad_layouts_are_rejected_with_the_fix(overrides, nodes, gpus, message):
    cfg = load_config(QWEN7B, overrides)
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, nodes=nodes, gpus_per_node=gpus)
    assert message in str(err.value)


def _render(tmp_path: Path, capsys, *args: str) -> str:
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    ckpt = tmp_path / "hf"
    if not ckpt.exists():  # submit loads the tokenizer as the trainer would: a real (tiny) one
        shutil.copytree(build_tokenizer(320), ckpt)
    rc = submit_main(
        [
            str(QWEN7B),
            f"model.hf_path={ckpt}",
            f"model.tokenizer_path={ckpt}",
            f"task.data_path={data}",
            "--dry-run",
            "--skip-cluster-checks",
            "--output-dir",
            str(tmp_path / "out"),
            *args,
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    return out.out


def _var(script: str, name: str) -> str:
    m = re.search(rf"^{name}=(.*)$", script, re.M)
    assert m, name
    return m.group(1)


def test_dry_run_dedicated_script(tmp_path, capsys):
    script = _render(
        tmp_path, capsys, "--nodes", "3", "--gpus-per-node", "8", "--partition", "gpu", "--time", "2:00:00"
    )
    for line in (
        "#SBATCH --nodes=3",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2:00:00",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:TERM@300",
        "--kill-on-bad-exit=1",
    ):
        assert line in script
    assert _var(script, "SERVER_MODE") == "dedicated" and _var(script, "SERVER_HOST") == "0.0.0.0"
    assert _var(script, "API_KEY_ENV") == DEFAULT_API_KEY_ENV
    assert _var(script, "TRAINER_NODES") == "2" and _var(script, "WORLD_SIZE") == "16"
    assert _var(script, "SERVER_SRUN_FLAGS") == "(--gres=gpu:8)"
    assert _var(script, "ENTRY_MODULE") == "megatron_acrl.train"
    # The key is made when the job runs, never written into the script.
    assert "token_urlsafe" in script and not re.search(r"--api-key\s+\S", script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 8), (1, 0)])
def test_dry_run_loopback_servers_are_keyed_by_whoever_starts_them(tmp_path, capsys, nodes, gpus):
    extra = ["rollout.num_servers=2"] if gpus else ["--ranks-per-node", "4"]
    script = _render(tmp_path, capsys, "--nodes", str(nodes), "--gpus-per-node", str(gpus), *extra)
    # Colocated: the job script keys the servers it starts; driver: the driver keys its own.
    assert _var(script, "API_KEY_ENV") == (DEFAULT_API_KEY_ENV if gpus else "''")
    assert _var(script, "SERVER_HOST") == "127.0.0.1"
    assert _var(script, "SERVER_MODE") == ("colocated" if gpus else "driver")


def _block(script: str, name: str) -> str:
    m = re.search(rf"# >>> {name}.*?\n(.*?)# <<< {name}", script, re.S)
    assert m, name
    return m.group(1)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs scontrol (apt-get install slurm-wlm)")
@pytest.mark.parametrize("nodelist", ["gpu[07-09]", "gpu07,gpu08,gpu09"])
def test_node_split_and_master_addr(tmp_path, capsys, nodelist):
    """The script's own node-split and URL blocks, run by bash with the real `scontrol` expanding a
    made-up node list (expansion needs no controller)."""
    script = _render(tmp_path, capsys, "--nodes", "3", "--gpus-per-node", "8")
    variables = script.split("# ---- rendered")[1].split("# ----")[0]
    probe = "\n".join(
        [
            "set -u",
            'log() { :; }; die() { echo "die $*"; exit 1; }',
            variables.split("\n", 1)[1],
            _block(script, "node-split"),
            'SERVER_MODE=dedicated; SRV_HOSTS=("${SERVER_HOSTS[@]}")',
            _block(script, "server-urls"),
            'echo "master=$MASTER_ADDR:$MASTER_PORT trainers=${TRAINER_HOSTS[*]} servers=${SERVER_HOSTS[*]}"',
            'echo "urls=${URLS[*]}"',
        ]
    )
    # scontrol wants some slurm.conf even to expand a host list offline.
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=p Nodes=localhost\n"
    )
    env = {**os.environ, "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "4242", "SLURM_CONF": str(conf)}
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "master=gpu07:24242 trainers=gpu07 gpu08 servers=gpu09" in out.stdout
    assert "urls=http://gpu09:30000 http://gpu09:30001 http://gpu09:30002 http://gpu09:30003" in out.stdout


@pytest.mark.parametrize(
    ("overrides", "sources", "first"),
    [
        (["parallel.pp=2"], 2, 12727),
        (["parallel.pp=2", "rollout.weight_sync=rank0"], 1, 18484),
        (["parallel.pp=2", "rollout.weight_sync_port=15000"], 2, 15000),
    ],
)
def test_weight_sync_ports_follow_the_layout(tmp_path, capsys, overrides, sources, first):
    """One port for rank 0's control store and one per source (a stage's sender), consecutive, in a
    slot of the job id (or from ``rollout.weight_sync_port``); the run gets the first as an override."""
    script = _render(tmp_path, capsys, "--nodes", "3", "--gpus-per-node", "8", *overrides)
    assert _var(script, "WEIGHT_SYNC_PORTS") == str(sources + 1)
    line = re.search(r"^WEIGHT_SYNC_PORT=.*$", script, re.M)
    assert line and '"rollout.weight_sync_port=$WEIGHT_SYNC_PORT"' in script
    probe = "\n".join(
        [
            f"WEIGHT_SYNC_PORTS={sources + 1}",
            f"WEIGHT_SYNC_PORT_FIXED={_var(script, 'WEIGHT_SYNC_PORT_FIXED')}",
            "SLURM_JOB_ID=4242",
            line.group(0),
            "echo $WEIGHT_SYNC_PORT",
        ]
    )
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30, check=True)
    assert int(out.stdout) == first


def test_bad_config_key_exits_2_with_the_config_message(capsys):
    assert submit_main([str(TINY), "training.num_stepz=3", "--dry-run", "--skip-cluster-checks"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'training.num_steps'" in err and "nothing was submitted" in err


def test_time_shorter_than_checkpoint_signal(capsys):
    rc = submit_main([str(TINY), "--time", "4:00", "--dry-run", "--skip-cluster-checks"])
    assert rc == 2 and "leaves no run time before the checkpoint signal" in capsys.readouterr().err


def test_exit_code_descriptions_match_the_bash_table():
    fn = exit_codes.bash_describe_function()
    for rc in (0, 2, 69, 137, 143):
        out = subprocess.run(["bash", "-c", f"{fn}\ndescribe_rc {rc}"], capture_output=True, text=True)
        assert out.stdout.strip() == exit_codes.describe(rc)


# ---- waiting for servers, against the stand-in server (no SLURM) ----------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def standin_server(tmp_path):
    port = _free_port()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"rollout:\n  base_port: {port}\n  api_key_env: TEST_KEY\nmodel:\n  hf_path: {tmp_path}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.launch_standin_server", str(cfg)],
        cwd=ROOT,
        env={**os.environ, "TEST_KEY": "right"},
        stdout=subprocess.DEVNULL,
    )
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_wait_servers_ok_with_the_right_key(standin_server):
    wait_for_servers([standin_server], timeout_s=60, api_key="right", poll_s=0.1)


@pytest.mark.parametrize("key", ["wrong", None])
def test_wait_servers_wrong_key_fails_at_once(standin_server, key):
    wait_for_servers([standin_server], timeout_s=60, api_key="right", poll_s=0.1)  # up
    with pytest.raises(ServersNotReady) as err:
        wait_for_servers([standin_server], timeout_s=600, api_key=key, poll_s=0.1)
    assert f"server 0 at {standin_server}: HTTP 401" in str(err.value)


def test_wait_servers_names_the_server_that_is_missing(standin_server):
    dead = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ServersNotReady) as err:
        wait_for_servers(
            [standin_server, dead], timeout_s=2, api_key="right", poll_s=0.1, log_hint="logs/s-{index}.log"
        )
    msg = str(err.value)
    assert f"server 1 at {dead}: not reachable" in msg and "logs/s-1.log" in msg
    assert f"server 0 at {standin_server}" not in msg


def test_wait_servers_stops_when_the_server_process_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    zombie_free_pid = proc.pid
    with pytest.raises(ServersNotReady) as err:
        wait_for_servers(
            [f"http://127.0.0.1:{_free_port()}"], timeout_s=600, poll_s=0.1, watch_pid=zombie_free_pid
        )
    assert "exited before becoming healthy" in str(err.value)
