"""One owner of SIGTERM / SIGINT: the entry point. Importing installs nothing; the entry point's block
turns the first signal into a stop request and the second into Interrupted, and on leaving stops the
bridge's servers and puts the previous handlers back."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_acrl.world.signals as signals_mod
from megatron_acrl.world.signals import Interrupted, stop_on_signals

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_driver_and_the_bridge_installs_no_handler():
    # Compared with the handlers the child starts with, not with Python's defaults: a child of a
    # background job inherits SIGINT ignored (and Python then installs no default_int_handler).
    code = (
        "import signal\n"
        "before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)\n"
        "import megatron_acrl.train, megatron_acrl.study.cli, megatron_acrl.world.signals\n"
        "import sglang_bridge.server, sglang_bridge.client, sglang_bridge.weight_sync\n"
        "after = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)\n"
        "assert after == before, (before, after)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture
def cleanups(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(signals_mod, "stop_all_servers", lambda: calls.append(1))
    return calls


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_asks_to_stop_the_second_interrupts(sig, cleanups):
    before = signal.getsignal(sig)
    with pytest.raises(Interrupted) as err, stop_on_signals() as stop:
        assert not stop.requested
        signal.raise_signal(sig)
        assert stop.requested and stop.signum == sig  # noted, nothing interrupted
        signal.raise_signal(sig)
        pytest.fail("the second signal did not interrupt")
    assert err.value.exit_code == 128 + sig
    assert cleanups == [1]  # the servers are stopped on the way out
    assert signal.getsignal(sig) is before  # and the previous handler is back


def test_leaving_normally_or_by_an_exception_cleans_up(cleanups):
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals():
        pass
    with pytest.raises(ValueError), stop_on_signals():
        raise ValueError("boom")
    assert cleanups == [1, 1]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_during_clean_up_is_only_noted(monkeypatch):
    def stop_servers() -> None:
        signal.raise_signal(signal.SIGTERM)  # a second signal while the servers are being stopped

    monkeypatch.setattr(signals_mod, "stop_all_servers", stop_servers)
    with stop_on_signals() as stop:
        signal.raise_signal(signal.SIGTERM)
    assert stop.signum == signal.SIGTERM


def test_train_entry_point_installs_the_handlers_for_the_run(monkeypatch, cleanups):
    import megatron_acrl.train as train

    seen = []

    def setup_run(cfg, args, stopping):  # the first thing run() does, under the handlers
        seen.append(signal.getsignal(signal.SIGTERM))
        raise RuntimeError("stop here")

    monkeypatch.setattr(train, "setup_run", setup_run)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="stop here"):
        train.run(None, None)  # type: ignore[arg-type]
    assert getattr(seen[0], "__func__", None) is signals_mod.StopSignals.handle
    assert signal.getsignal(signal.SIGTERM) is before and cleanups == [1]

    def interrupted(cfg, args):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(train, "run", interrupted)
    assert train.main(["--config", str(ROOT / "configs" / "tiny_dense.yaml")]) == 128 + signal.SIGTERM


def test_a_stopped_study_starts_no_run(tmp_path, monkeypatch, cleanups):
    from megatron_acrl.study import run as study_run
    from megatron_acrl.study.grid import load_grid

    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(
        f"base: {ROOT / 'configs/tiny_dense.yaml'}\nshared_server: false\n"
        "arms:\n  a: [correction.method=none]\n"
    )
    started = []
    monkeypatch.setattr(study_run, "run_arm", lambda *a, **k: started.append(a))
    with stop_on_signals() as stop:
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(study_run.StudyStopped, match="SIGTERM received"):
            study_run.run_grid(load_grid(grid_file), tmp_path / "runs", stop)
    assert started == []


def test_a_second_signal_during_clean_up_of_a_checkpointed_stop_exits_0(monkeypatch, cleanups, capsys):
    """The first SIGTERM stops the loop and the step is checkpointed; a second one while the run closes
    (``ctx.close()`` runs inside the handlers' block) loses nothing: exit 0, naming the step."""
    import types

    import megatron_acrl.train as train

    saved = []

    class Ctx:
        rank = 0
        cfg = types.SimpleNamespace(training=types.SimpleNamespace(checkpoint_dir="/ckpt"))
        servers = ()
        last_checkpoint_step = -1
        run_dir = ROOT

        def start_logging(self, *_a):
            pass

        def close(self):
            signal.raise_signal(signal.SIGTERM)  # the second signal, while cleaning up

    ctx = Ctx()

    class Producer:
        def save_checkpoint(self, state):
            saved.append(state.step)
            ctx.last_checkpoint_step = state.step

        def close(self):
            pass

    def loop(ctx_, state, producer, stop):
        signal.raise_signal(signal.SIGTERM)  # the first: stop at the end of the step
        assert stop.requested
        return types.SimpleNamespace(step=3)

    monkeypatch.setattr(train, "setup_run", lambda cfg, args, stopping: ctx)
    monkeypatch.setattr(train, "backends_line", lambda *a: "")
    monkeypatch.setattr(train, "load_driver_state", lambda c: (types.SimpleNamespace(step=0), None))
    monkeypatch.setattr(train, "make_producer", lambda *a: Producer())
    monkeypatch.setattr(train, "train", loop)
    assert train.main(["--config", str(ROOT / "configs" / "tiny_dense.yaml")]) == 0
    assert saved == [3] and cleanups == [1]
    err = capsys.readouterr().err
    assert "step 3 is checkpointed" in err and "without a checkpoint" not in err
