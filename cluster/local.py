"""The local twin of cluster.yaml: Ray's fake_multinode autoscaler on this machine.

``up`` starts a Ray head (no CPUs, like the cloud head) whose autoscaler launches and removes
"nodes" of cluster/local.yaml's types as work asks for their resources; ``down`` stops exactly
the processes of that cluster (never a bare ``ray stop``, which would stop every Ray of the user) and
removes its temp dir.
The twin's state (its config, ports, temp dir) lives in ``~/.raywright/local-cluster/``.
"""

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import psutil
import yaml
from pydantic import field_validator

from train.schema import Section, read_record

TWIN_CONFIG = Path(__file__).with_name("local.yaml")
STATE_DIR = Path.home() / ".raywright" / "local-cluster"


TEMP_DIR_PREFIX = "rwtwin-"


class TwinState(Section):
    """What ``up`` records of the twin it started (``state.json``), for ``down`` and the job commands."""

    address: str  # the GCS's, host:port
    dashboard: str  # the job API's URL
    temp_dir: str  # Ray's, made by ``up`` for this twin only: ``down`` deletes it

    @field_validator("temp_dir")
    @classmethod
    def _made_by_up(cls, path: str) -> str:
        if not os.path.basename(path).startswith(TEMP_DIR_PREFIX):
            raise ValueError(f"not a directory `up` made ({TEMP_DIR_PREFIX}*), the only ones `down` deletes")
        return path


def read_state(state_dir: Path = STATE_DIR) -> TwinState | None:
    """The state of the twin that is up; None where none is. ConfigError naming the file where it is not one."""
    return read_record(TwinState, str(state_dir / "state.json"), "a local twin's state")


def up(state_dir: Path = STATE_DIR) -> TwinState:
    """Start the twin."""
    if read_state(state_dir):
        raise RuntimeError(f"a local twin is already up (state in {state_dir}); `python -m cluster down --local` first")
    import ray

    # Imports torch: only the command that starts a twin pays for it.
    from train.process_group import free_ports, own_state_api_env

    state_dir.mkdir(parents=True, exist_ok=True)
    ip = ray.util.get_node_ip_address()
    gcs_port, dashboard_port, agent_port, client_port, metrics_port, runtime_env_port = free_ports(6)
    config = yaml.safe_load(TWIN_CONFIG.read_text())
    config["provider"]["gcs_address"] = f"{ip}:{gcs_port}"
    autoscaler_config = state_dir / "autoscaler.yaml"
    autoscaler_config.write_text(yaml.safe_dump(config))
    temp_dir = tempfile.mkdtemp(prefix=f"/tmp/{TEMP_DIR_PREFIX}")
    # Free ports for everything with a fixed default, so the twin runs beside another Ray on this machine.
    command = [
        "ray", "start", "--head", f"--port={gcs_port}", "--num-cpus=0",
        f"--autoscaling-config={autoscaler_config}", f"--temp-dir={temp_dir}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={agent_port}", f"--ray-client-server-port={client_port}",
        f"--metrics-export-port={metrics_port}", f"--runtime-env-agent-port={runtime_env_port}",
    ]  # fmt: skip
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", **own_state_api_env(dashboard_port)}
    try:
        started = subprocess.run(command, env=env, capture_output=True, text=True)
    except OSError as exc:
        shutil.rmtree(temp_dir)
        raise RuntimeError(f"cannot run `ray start`: {exc.strerror} (is Ray installed in this environment?)") from None
    if started.returncode:
        shutil.rmtree(temp_dir, ignore_errors=True)  # made above; what a failed start left in it is of no use
        last = (started.stderr.strip() or started.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"`ray start` failed (exit {started.returncode}): {last}")
    state = TwinState(address=f"{ip}:{gcs_port}", dashboard=f"http://127.0.0.1:{dashboard_port}", temp_dir=temp_dir)
    (state_dir / "state.json").write_text(state.model_dump_json())
    return state


def _processes_of(state: TwinState) -> list[psutil.Process]:
    """Every process of the twin: its command line names the twin's temp dir or GCS address."""
    marks = (state.temp_dir, state.address, f"--gcs_server_port={state.address.rsplit(':', 1)[1]}")
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if process.pid != os.getpid() and any(mark in command for mark in marks):
            found.append(process)
    return found


def down(state_dir: Path = STATE_DIR, grace_s: float = 10.0) -> int:
    """Stop the twin's processes (SIGTERM, then SIGKILL) and remove its temp dir (its sessions' logs); how
    many processes there were."""
    state = read_state(state_dir)
    if not state:
        return 0
    processes = _processes_of(state)
    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        process.kill()
    shutil.rmtree(state.temp_dir, ignore_errors=True)  # made by ``up``, for this twin only
    (state_dir / "state.json").unlink()
    return len(processes)
