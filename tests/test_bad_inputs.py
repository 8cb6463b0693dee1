"""Bad inputs fail early (issue #25, "Faults and bad input"): every listed input goes through the
real entry point (``megatron_acrl.train.main``, what ``python -m megatron_acrl.train`` runs) and must
exit 2 with the key (or file:line) and the fix named, before anything starts: ``run`` (which
initialises the world, builds the model and starts the servers) is replaced by a tripwire.

One table; each row builds its input in a temporary directory. The first rows are the inputs that
failed late (with a traceback, some after the server started) before the pre-flight
(:mod:`megatron_acrl.run.preflight`); the last ones were caught already and stay caught.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import megatron_acrl.train as train
from megatron_acrl.config.exit_codes import CONFIG_ERROR, SERVERS_UNAVAILABLE
from megatron_acrl.warmstart.tiny_model import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "tiny_dense.yaml")
GOOD_ROW = {"question": "What is 1 + 1?", "answer": "#### 2"}


def _data(tmp: Path, content: str | bytes, name: str = "data.jsonl") -> list[str]:
    """Overrides of a GSM8K task reading ``content`` from a file in ``tmp``."""
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return ["task.name=gsm8k", f"task.data_path={path}"]


def _good_rows(n: int = 3) -> str:
    return "".join(json.dumps(GOOD_ROW) + "\n" for _ in range(n))


def _hf(tmp: Path) -> list[str]:
    """``model.hf_path`` of a real tiny HF checkpoint of the base config's model (its config.json
    says rotary_base 10000, norm_epsilon 1e-6, ffn_hidden_size 128, no q/k norm)."""
    from megatron_acrl.config import ModelConfig
    from megatron_acrl.warmstart.tiny_model import build_checkpoint

    return [f"model.hf_path={build_checkpoint(ModelConfig(), seed=0, cache_dir=tmp / 'models')}"]


def _yaml(tmp: Path, text: str) -> str:
    path = tmp / "dup.yaml"
    path.write_text(Path(BASE).read_text() + text)
    return str(path)


# (id, setup(tmp) -> (config path, argv after it), the key named, words of the message)
Setup = Callable[[Path], tuple[str, list[str]]]
CASES: list[tuple[str, Setup, str, str]] = [
    # -- data files
    (
        "json_broken",
        lambda t: (BASE, _data(t, _good_rows() + '{"question": "1+\n')),
        "task.data_path",
        "data.jsonl:4: not valid JSON",
    ),
    ("json_empty", lambda t: (BASE, _data(t, "")), "task.data_path", "no examples"),
    (
        "json_number",
        lambda t: (BASE, _data(t, _good_rows() + "5\n")),
        "task.data_path",
        "data.jsonl:4: expected a JSON object",
    ),
    (
        "json_string",
        lambda t: (BASE, _data(t, '"a question"\n')),
        "task.data_path",
        "data.jsonl:1: expected a JSON object",
    ),
    (
        "not_utf8",
        lambda t: (BASE, _data(t, _good_rows(2).encode() + b'{"question": "\xff"}\n')),
        "task.data_path",
        "data.jsonl:3: not UTF-8",
    ),
    (
        "missing_field",
        lambda t: (BASE, _data(t, '{"question": "2+2"}\n')),
        "task.data_path",
        "missing field 'answer'",
    ),
    (
        "answer_no_number",
        lambda t: (BASE, _data(t, '{"question": "2+2", "answer": "four"}\n')),
        "task.data_path",
        "answer has no number",
    ),
    (
        "data_is_directory",
        lambda t: (BASE, ["task.name=gsm8k", f"task.data_path={t}"]),
        "task.data_path",
        "is a directory",
    ),
    # -- prompt length, vocab
    (
        "prompt_too_long",
        lambda t: (
            BASE,
            _data(t, _good_rows() + json.dumps({"question": "1 + 2 " * 40, "answer": "#### 3"}) + "\n"),
        ),
        "rollout.max_prompt_len",
        "data.jsonl:4 (",
    ),
    (
        "vocab_below_tokenizer",
        lambda t: (BASE, [f"model.tokenizer_path={build_tokenizer(320)}", "model.vocab_size=300"]),
        "model.vocab_size",
        "smaller than the tokenizer's 320",
    ),
    ("vocab_below_bytes", lambda t: (BASE, ["model.vocab_size=100"]), "model.vocab_size", "must be >= "),
    # -- directories
    (
        "ckpt_is_file",
        lambda t: (BASE, [f"training.checkpoint_dir={_file(t)}"]),
        "training.checkpoint_dir",
        "is a file",
    ),
    (
        "ckpt_not_writable",
        lambda t: (BASE, ["training.checkpoint_dir=/proc/acrl-ckpt"]),
        "training.checkpoint_dir",
        "not writable",
    ),
    ("run_dir_is_file", lambda t: (BASE, ["--run-dir", str(_file(t))]), "--run-dir", "is a file"),
    ("run_dir_not_writable", lambda t: (BASE, ["--run-dir", "/proc/acrl-run"]), "--run-dir", "not writable"),
    (
        "load_rollouts_missing",
        lambda t: (BASE, ["--load-rollouts", str(t / "none")]),
        "--load-rollouts",
        "no directory",
    ),
    (
        "save_rollouts_is_file",
        lambda t: (BASE, ["--save-rollouts", str(_file(t))]),
        "--save-rollouts",
        "is a file",
    ),
    # -- rollout
    (
        "request_timeout_zero",
        lambda t: (BASE, ["rollout.request_timeout_s=0"]),
        "rollout.request_timeout_s",
        "must be > 0",
    ),
    (
        "request_timeout_negative",
        lambda t: (BASE, ["rollout.request_timeout_s=-5"]),
        "rollout.request_timeout_s",
        "must be > 0",
    ),
    (
        "router_timeout_zero",
        lambda t: (BASE, ["rollout.router_timeout_s=0"]),
        "rollout.router_timeout_s",
        "must be >= 1 second",
    ),
    (
        "startup_timeout_zero",
        lambda t: (BASE, ["rollout.startup_timeout_s=0"]),
        "rollout.startup_timeout_s",
        "must be > 0",
    ),
    (
        "server_cpus_absent",
        lambda t: (BASE, ["rollout.server_cpus=[4093, 4094]"]),
        "rollout.server_cpus",
        "[4093, 4094]",
    ),
    (
        "api_key_env_unset",
        lambda t: (BASE, ["rollout.api_key_env=ACRL_TEST_KEY_NOT_SET"]),
        "rollout.api_key_env",
        "ACRL_TEST_KEY_NOT_SET, which is not set",
    ),
    (
        "fp8_real_on_cpu",
        lambda t: (BASE, ["rollout.device=cpu", "rollout.fp8_mode=real"]),
        "rollout.fp8_mode",
        "needs a cuda server",
    ),
    pytest.param(
        "fp8_real_auto_device",
        lambda t: (BASE, ["rollout.fp8_mode=real"]),
        "rollout.fp8_mode",
        "needs a cuda server",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="auto is cuda here: real FP8 is right"),
        id="fp8_real_auto_device",
    ),
    # -- logging, YAML
    (
        "wandb_online_no_key",
        lambda t: (BASE, ["logging.wandb_mode=online"]),
        "logging.wandb_mode",
        "WANDB_API_KEY",
    ),
    (
        "yaml_section_twice",
        lambda t: (_yaml(t, "model:\n  num_layers: 4\n"), []),
        "model",
        "'model' is given twice (first on line 4)",
    ),
    (
        "yaml_key_twice",
        lambda t: (_field_twice(t), []),
        "rollout.max_prompt_len",
        "'max_prompt_len' is given twice",
    ),
    # -- algorithm (issue 32: the algorithm table)
    (
        "overlong_buffer_past_max_new_tokens",
        lambda t: (BASE, ["algorithm.overlong_buffer_len=13"]),  # tiny_dense: max_new_tokens 12
        "algorithm.overlong_buffer_len",
        "exceeds rollout.max_new_tokens=12",
    ),
    (
        "dr_grpo_with_std",
        lambda t: (BASE, ["algorithm.name=dr_grpo", "algorithm.grpo_norm_std=true"]),
        "algorithm.grpo_norm_std",
        "algorithm.name=dr_grpo requires grpo_norm_std=false",
    ),
    # -- caught already (they stay caught)
    (
        "algorithm_name_unknown",
        lambda t: (BASE, ["algorithm.name=dapoo"]),
        "algorithm.name",
        "'grpo', 'dr_grpo', 'dapo', 'ppo'; got 'dapoo' (did you mean 'dapo'?)",
    ),
    (
        "unknown_key",
        lambda t: (BASE, ["rollout.temprature=0.5"]),
        "rollout.temprature",
        "did you mean 'rollout.temperature'",
    ),
    ("wrong_type", lambda t: (BASE, ["training.lr=fast"]), "training.lr", "expected float"),
    (
        "data_path_missing",
        lambda t: (BASE, ["task.name=gsm8k", f"task.data_path={t / 'none.jsonl'}"]),
        "task.data_path",
        "no such file",
    ),
    ("tp_not_dividing", lambda t: (BASE, ["parallel.tp=3"]), "parallel.tp", "divisible by tp=3"),
    # -- issue #36: the model config against its checkpoint's config.json, ACRL's reference lag,
    #    the keys a resume may be told to accept
    (
        "hf_rotary_base_disagrees",
        lambda t: (BASE, [*_hf(t), "model.rotary_base=5e5"]),
        "model.rotary_base",
        "5e5 disagrees with",
    ),
    (
        "hf_norm_epsilon_disagrees",
        lambda t: (BASE, [*_hf(t), "model.norm_epsilon=1e-5"]),
        "model.norm_epsilon",
        "which sets norm_epsilon = 1e-06",
    ),
    (
        "hf_ffn_hidden_size_disagrees",
        lambda t: (BASE, [*_hf(t), "model.ffn_hidden_size=256"]),
        "model.ffn_hidden_size",
        "256 disagrees with",
    ),
    (
        "hf_qk_layernorm_disagrees",
        lambda t: (BASE, [*_hf(t), "model.qk_layernorm=true"]),
        "model.qk_layernorm",
        "which sets qk_layernorm = False",
    ),
    (
        "reference_lag_unreachable",
        lambda t: (BASE, ["correction.reference_lag=5"]),
        "correction.reference_lag",
        "5 is never reached: this run samples every batch at a lag of at most 0",
    ),
    (
        "allow_changes_model_shape",
        lambda t: (BASE, ["training.resume_allow_changes=[model.ffn_hidden_size]"]),
        "training.resume_allow_changes",
        "model.ffn_hidden_size can never change on resume",
    ),
    (
        "allow_changes_misspelt",
        lambda t: (BASE, ["training.resume_allow_changes=[task.num_digit]"]),
        "training.resume_allow_changes",
        "did you mean task.num_digits?",
    ),
    (
        "allow_changes_not_checked",
        lambda t: (BASE, ["training.resume_allow_changes=[training.lr]"]),
        "training.resume_allow_changes",
        "training.lr may change on every resume without being listed",
    ),
]


def _file(tmp: Path) -> Path:
    path = tmp / "a-file"
    path.write_text("not a directory\n")
    return path


def _field_twice(tmp: Path) -> str:
    text = (
        Path(BASE)
        .read_text()
        .replace("  max_prompt_len: 32\n", "  max_prompt_len: 32\n  max_prompt_len: 64\n")
    )
    path = tmp / "field-twice.yaml"
    path.write_text(text)
    return str(path)


def _case_params() -> list:
    out = []
    for case in CASES:
        out.append(case if hasattr(case, "values") else pytest.param(*case, id=case[0]))
    return out


@pytest.fixture
def tripwire(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``train.run`` (world, model, servers) replaced: a bad input must be refused before it."""
    started: list[str] = []
    monkeypatch.setattr(train, "run", lambda cfg, args, prepare=None: started.append("run"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("ACRL_TEST_KEY_NOT_SET", raising=False)
    return started


@pytest.mark.parametrize(("name", "setup", "key", "words"), _case_params())
def test_bad_input_fails_before_anything_starts(
    name: str, setup: Setup, key: str, words: str, tmp_path: Path, tripwire: list[str], monkeypatch, capsys
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc W&B login
    config, argv = setup(tmp_path)
    if "--run-dir" not in argv:
        argv = [*argv, "--run-dir", str(tmp_path / "run")]
    rc = train.main(["--config", config, *argv])
    err = capsys.readouterr().err
    assert not tripwire, f"{name}: the run started"
    assert rc == CONFIG_ERROR, f"{name}: exit {rc}\n{err}"
    assert f"  {key}: " in err, f"{name}: {key!r} not named:\n{err}"
    assert words in err, f"{name}: {words!r} not in:\n{err}"
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists(), f"{name}: the run directory was made"


def test_a_good_input_passes_the_preflight(tmp_path: Path, tripwire: list[str]) -> None:
    """The checks refuse what is wrong only: a good GSM8K file and writable directories reach ``run``."""
    data = _data(tmp_path, _good_rows(8))
    argv = ["--config", BASE, *data, f"training.checkpoint_dir={tmp_path / 'ck'}", "--run-dir", str(tmp_path)]
    assert train.main(argv) == 0
    assert tripwire == ["run"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # the probes left nothing


def test_cli_exits_2_on_a_broken_data_file(tmp_path: Path) -> None:
    """The real command line (a process of its own): exit 2, file:line and no traceback."""
    data = _data(tmp_path, _good_rows() + "[1, 2]\n")
    cmd = [
        sys.executable,
        "-m",
        "megatron_acrl.train",
        "--config",
        BASE,
        *data,
        "--run-dir",
        str(tmp_path / "r"),
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == CONFIG_ERROR, out.stderr
    assert "task.data_path" in out.stderr and "data.jsonl:4: expected a JSON object" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()


def test_server_cores_are_the_machines_not_the_trainers(tmp_path: Path) -> None:
    """A trainer pinned to core 0 may start its server on core 1 (the async benchmark's layout): the
    check reads the job's cpuset, not the trainer's own affinity."""
    from sglang_bridge.server_spec import host_cores

    cpuset = tmp_path / "cpuset.cpus.effective"
    cpuset.write_text("0-2,5\n")
    assert host_cores(cpuset) == {0, 1, 2, 5}
    assert host_cores(tmp_path / "absent") == set(range(os.cpu_count() or 1))
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        mine = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, {min(mine)})
            assert max(mine) in host_cores()
        finally:
            os.sched_setaffinity(0, mine)


def test_the_launcher_exits_2_without_a_traceback_on_a_refused_config(tmp_path: Path) -> None:
    """``python -m launch.torchrun`` (what ``make demo`` and the job script run): every rank exits 2
    on a bad config, so the launcher does too, without torch's ChildFailedError traceback."""
    cmd = [
        sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "2",
        "-m", "megatron_acrl.train", "--config", BASE, "correction.reference_lag=5",
        "--run-dir", str(tmp_path / "r"),
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == CONFIG_ERROR, out.stderr
    assert "correction.reference_lag: 5 is never reached" in out.stderr
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr
    assert not (tmp_path / "r").exists()


def test_the_launcher_passes_on_2_only_when_every_failed_rank_refused() -> None:
    from launch.torchrun import refused_exit_code

    assert refused_exit_code({0: 2, 1: 2}) == CONFIG_ERROR
    assert refused_exit_code({0: -15, 1: 2}) == CONFIG_ERROR  # rank 0 stopped by the agent after 1 refused
    assert refused_exit_code({0: 2, 1: 1}) is None  # a crash next to a refusal: torch reports it
    assert refused_exit_code({0: -9}) is None and refused_exit_code({}) is None
    # rank 0 alone could not have its servers, and rank 1 followed it (issue #36 item 7)
    assert refused_exit_code({0: SERVERS_UNAVAILABLE, 1: SERVERS_UNAVAILABLE}) == SERVERS_UNAVAILABLE
    assert refused_exit_code({0: SERVERS_UNAVAILABLE, 1: -15}) == SERVERS_UNAVAILABLE
    assert refused_exit_code({0: SERVERS_UNAVAILABLE, 1: 1}) is None  # rank 1's own crash: reported
    assert refused_exit_code({0: SERVERS_UNAVAILABLE, 1: CONFIG_ERROR}) is None  # two stories: torch's


def _held_port(tmp: Path, stack: contextlib.ExitStack) -> list[str]:
    """``rollout.base_port`` on a port another process (this test) listens on."""
    sock = stack.enter_context(socket.socket())
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return [f"rollout.base_port={sock.getsockname()[1]}"]


def _refused_url(tmp: Path, stack: contextlib.ExitStack) -> list[str]:
    """``rollout.server_urls`` naming a port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [f"rollout.server_urls=[http://127.0.0.1:{port}]", "rollout.api_key_env=ACRL_TEST_KEY"]


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (_held_port, "rollout.base_port: port"),
        # the same path from a second cause: the slow tier (each case starts two Megatron ranks)
        pytest.param(_refused_url, "no server listens there", marks=pytest.mark.slow),
    ],
    ids=["port_held", "server_url_refused"],
)
def test_the_launcher_passes_on_rank_0s_code_when_rank_0_alone_refuses_after_start_up(
    setup: Callable[[Path, contextlib.ExitStack], list[str]], words: str, tmp_path: Path
) -> None:
    """Issue #36 item 7: only rank 0 starts or reaches the servers, so only rank 0 refuses a held
    port or an unreachable URL, after the world started. Rank 1 used to die in its next collective
    with a raw gloo traceback (exit 1, and the launcher's ChildFailedError); now it prints one line
    pointing at rank 0's message and exits with rank 0's code, which the launcher passes on."""
    with contextlib.ExitStack() as stack:
        cmd = [
            sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "2",
            "-m", "megatron_acrl.train", "--config", BASE, "parallel.tp=2", "logging.wandb_mode=disabled",
            *setup(tmp_path, stack), "--run-dir", str(tmp_path / "r"),
        ]  # fmt: skip
        env = {**os.environ, "ACRL_TEST_KEY": "a-test-key-0123456789", "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == SERVERS_UNAVAILABLE, out.stderr[-4000:]
    assert words in out.stderr, out.stderr[-4000:]
    assert f"rank 1: stopped because rank 0 refused the run (exit {SERVERS_UNAVAILABLE})" in out.stderr
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr, out.stderr[-4000:]
    assert "Connection closed by peer" not in out.stderr, out.stderr[-4000:]  # gloo's raw error


@pytest.mark.parametrize(
    ("name", "setup", "key", "words"),
    [c for c in _case_params() if c.id in ("json_broken", "not_utf8", "missing_field", "prompt_too_long")],
)
def test_submit_dry_run_refuses_what_the_trainer_refuses(
    name: str, setup: Setup, key: str, words: str, tmp_path: Path, capsys
) -> None:
    """``launch.submit --dry-run`` runs the trainer's input checks (data, tokenizer, prompt lengths):
    a job that would fail on them is never queued."""
    from launch.submit import main as submit_main

    config, argv = setup(tmp_path)
    rc = submit_main([config, *argv, "--dry-run", "--skip-cluster-checks", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == CONFIG_ERROR, f"{name}: exit {rc}\n{err}"
    assert f"  {key}: " in err and words in err and "nothing was submitted" in err
