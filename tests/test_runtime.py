"""Output-directory rules (overwrite, lock, resume), torn metrics and worker/device resolution: no model needed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from vlforge.config import ConfigError, SFTConfig, dump_config
from vlforge.train import runtime
from vlforge.train.manifest import write_manifest
from vlforge.train.metrics import MetricsLog, read_metrics
from vlforge.train.runtime import (LOCK_NAME, choose_device, prepare_output_dir, release_output_dir,
                                    resolve_num_workers)


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    for path in list(runtime._HELD):  # each test starts with no lock held by this process
        release_output_dir(path)


def _run_dir(out):
    """A directory holding every kind of entry a vlforge run writes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(SFTConfig()))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "eval.json").write_text("{}")
    for name in ("loss.png", "reward.png", "events.out.tfevents.1.host"):
        (out / name).write_bytes(b"x")
    for d in ("checkpoint-2", ".tmp-checkpoint-3-123", "superseded-1-20250101-000000/checkpoint-2", "tensorboard"):
        (out / d).mkdir(parents=True)
        (out / d / "f").write_bytes(b"x")
    for d in ("checkpoint-2", "superseded-1-20250101-000000/checkpoint-2"):  # checkpoints as a save leaves them
        (out / d / "trainer_state.json").write_text('{"step": 2}')
        write_manifest(out / d)
    return out


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.name != LOCK_NAME)


def test_overwrite_refuses_a_directory_with_foreign_files_and_removes_nothing(tmp_path):
    out = _run_dir(tmp_path / "run")
    (out / "train.jsonl").write_text('{"messages": []}\n')  # the user's data living in output_dir
    (out / "images").mkdir()
    before = _tree(out)
    with pytest.raises(ConfigError, match=r"overwrite=true removes only what a vlforge run wrote.*images/, train\.jsonl"):
        prepare_output_dir(out, "never", overwrite=True)
    assert _tree(out) == before  # the run's own files stay too: nothing is removed unless all may go
    assert (out / "train.jsonl").read_text() == '{"messages": []}\n'


def test_overwrite_removes_exactly_what_a_run_wrote(tmp_path):
    out = _run_dir(tmp_path / "run")
    assert prepare_output_dir(out, "never", overwrite=True) is None
    assert [p.name for p in out.iterdir()] == [LOCK_NAME]


def test_look_alikes_of_run_files_are_foreign(tmp_path):
    out = _run_dir(tmp_path / "run")
    (out / "config.yaml").write_text("learning_rate: 0.1\n")  # another tool's config.yaml
    with pytest.raises(ConfigError, match=r"also holds config\.yaml"):
        prepare_output_dir(out, "never", overwrite=True)
    (out / "config.yaml").write_text(dump_config(SFTConfig()))
    (tmp_path / "mine").mkdir()
    (out / "checkpoint-9").symlink_to(tmp_path / "mine")  # a link named like a checkpoint points at user data
    with pytest.raises(ConfigError, match=r"also holds checkpoint-9"):
        prepare_output_dir(out, "never", overwrite=True)
    assert (tmp_path / "mine").is_dir()


def test_non_empty_directory_needs_resume_or_overwrite(tmp_path):
    out = _run_dir(tmp_path / "run")
    with pytest.raises(ConfigError, match="is not empty"):
        prepare_output_dir(out, "never", overwrite=False)
    assert prepare_output_dir(out, "auto", overwrite=False) == out / "checkpoint-2"


def test_a_lock_file_alone_is_an_empty_directory(tmp_path):
    # a run that stopped after taking the lock (e.g. bad data) leaves only the lock file behind
    (tmp_path / LOCK_NAME).write_text("12345\n")
    assert prepare_output_dir(tmp_path, "never", overwrite=False) is None


def test_resume_auto_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "data.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"resume=auto: .* is not a vlforge run .*data\.jsonl"):
        prepare_output_dir(tmp_path, "auto", overwrite=False)
    # nothing written there: no config.yaml, no lock file left in someone else's directory
    assert [p.name for p in tmp_path.iterdir()] == ["data.jsonl"]
    assert not runtime._HELD


def test_resume_auto_on_a_run_with_foreign_files_continues_it(tmp_path):
    out = _run_dir(tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    assert prepare_output_dir(out, "auto", overwrite=False) == out / "checkpoint-2"


# ----------------------------------------------------------------------------- the lock

# Another process holding (or probing) the lock the way a second vlforge run would: lockf on the
# same file. Plain Python, so the test does not pay for a second torch import.
_HOLDER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0); os.write(fd, f"{os.getpid()}\\n".encode())
    print("locked", flush=True)
    sys.stdin.read()  # hold until the test closes stdin
""")
_PROBE = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        print("held by", os.read(fd, 64).decode().strip())
        sys.exit(1)
    print("free")
""")


def test_a_second_run_is_refused_with_the_holders_pid_until_it_exits(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / LOCK_NAME)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {holder.pid}\b"):
            prepare_output_dir(tmp_path, "never", overwrite=False)
        with pytest.raises(ConfigError, match=rf"pid {holder.pid}\b"):  # resume and overwrite too
            prepare_output_dir(tmp_path, "auto", overwrite=True)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the holder is dead: its pid is still in the file, but the kernel dropped its lock
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(holder.pid)
    assert prepare_output_dir(tmp_path, "never", overwrite=False) is None
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())


def test_the_lock_is_held_for_the_run_and_released_on_request(tmp_path):
    prepare_output_dir(tmp_path, "never", overwrite=False)
    probe = [sys.executable, "-c", _PROBE, str(tmp_path / LOCK_NAME)]
    held = subprocess.run(probe, capture_output=True, text=True)
    assert held.returncode == 1 and held.stdout.strip() == f"held by {os.getpid()}"
    # a later run in this same process (sequential runs, the demo, tests) is not refused by itself
    assert prepare_output_dir(tmp_path, "auto", overwrite=False) is None
    release_output_dir(tmp_path)
    assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "free"


def test_a_forked_child_does_not_keep_the_lock_after_the_run_releases_it(tmp_path):
    """A process forked while the run holds the lock (a DataLoader worker, which can outlive the run)
    holds no share of it: once the run releases it, another process and a next run here take it.
    (With flock the fork shared it: on CUDA, where the loader forks, a second run in one process on
    the same directory was refused as in use by itself.)"""
    prepare_output_dir(tmp_path, "never", overwrite=False)
    child = os.fork()
    if child == 0:  # the forked copy holds the lock file's descriptor, as a loader worker does
        time.sleep(30)
        os._exit(0)
    try:
        release_output_dir(tmp_path)
        probe = [sys.executable, "-c", _PROBE, str(tmp_path / LOCK_NAME)]
        assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "free"
        assert prepare_output_dir(tmp_path, "auto", overwrite=False) is None  # a next run in this process
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        release_output_dir(tmp_path)


# ----------------------------------------------------------------------------- unwritable output_dir


def test_output_dir_that_is_a_file_or_under_one_fails_fast(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        prepare_output_dir(f, "never", overwrite=False)
    with pytest.raises(ConfigError, match=r"output_dir=.*file/run: cannot write there \(Not a directory\)"):
        prepare_output_dir(f / "run", "never", overwrite=False)


def test_read_only_output_dir_fails_fast(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        try:
            (ro / "probe").touch()
            (ro / "probe").unlink()
            pytest.skip("running as root: mode 0500 does not stop this user writing")
        except PermissionError:
            pass
        with pytest.raises(ConfigError, match=r"ro: cannot write there \(Permission denied\)"):
            prepare_output_dir(ro, "never", overwrite=False)
        with pytest.raises(ConfigError, match=r"cannot write there"):
            prepare_output_dir(ro / "sub", "never", overwrite=False)
    finally:
        ro.chmod(0o700)


# ----------------------------------------------------------------------------- metrics.jsonl


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')  # killed mid-write
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert f"{path}:3: dropped a line" in capsys.readouterr().err

    log = MetricsLog(tmp_path, resume_step=None)  # appending after a torn line would glue rows together
    assert "3: dropped a line" in capsys.readouterr().err
    log.log(3, {"loss": 1.0})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert capsys.readouterr().err == ""  # the torn line is gone from the file

    path.write_text(path.read_text() + "\0\0\0\0")  # a power loss can leave NUL bytes
    log = MetricsLog(tmp_path, resume_step=1)  # resume: rows past the checkpoint go too
    log.close()
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]


# ----------------------------------------------------------------------------- workers and devices


def test_num_workers_auto_follows_the_cpu_count(monkeypatch):
    cuda = torch.device("cuda")  # constructing a device needs no GPU
    assert resolve_num_workers(3, cuda) == 3 and resolve_num_workers(0, cuda) == 0
    assert resolve_num_workers("auto", torch.device("cpu")) == 0  # CPU training: workers would take its cores
    for cpus, workers in [(1, 0), (2, 1), (4, 3), (64, 4)]:
        monkeypatch.setattr(runtime, "usable_cpus", lambda cpus=cpus: cpus)
        assert resolve_num_workers("auto", cuda) == workers


def test_device_problems_are_named():
    def problem(spec, cuda, gpus, mps=False):
        device, why = choose_device(spec, cuda, gpus, mps_available=mps)
        return None if why is None else " ".join(why)

    assert problem("auto", False, 0) is None and problem("cpu", False, 0) is None
    assert problem("cuda:1", True, 2) is None
    assert "only 2 GPU(s)" in problem("cuda:2", True, 2)
    assert "no CUDA GPU" in problem("cuda", False, 0)
    assert "MPS" in problem("mps", False, 0) and problem("mps", False, 0, mps=True) is None
    assert "not a device" in problem("tpu", False, 0)