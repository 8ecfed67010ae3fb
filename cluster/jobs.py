"""Submitting raywright's jobs through Ray's job API: config checked first, repo as working_dir, auth token sent.

The address is the cluster's dashboard (job API): ``--address``, else ``RAY_ADDRESS`` when it is
an http(s) URL, else http://127.0.0.1:8265, where ``ray dashboard cluster.yaml`` forwards it.
The token is ``RAY_AUTH_TOKEN``, or the file ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``.
"""

import os
import shlex
import time
from pathlib import Path

from ray.exceptions import AuthenticationError
from ray.job_submission import JobSubmissionClient

from train.schema import ConfigError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
KINDS = ("train", "tune", "serve")
AGENT_WAIT_S = 60
# How long `stop` lets a job end on its own before Ray's job supervisor SIGKILLs it (Ray's default: 3 s).
# Ray Train's graceful abort, which withdraws the run's autoscaler request, took longer than 3 s on a
# loaded machine; killed before that, the run's nodes stay up until the request expires (3 minutes).
STOP_WAIT_S = 30
# Never uploaded: secrets (environment files, keys, virtual environments, Ray's token dir), local runs,
# data, caches and git history.
EXCLUDES = [
    ".env*", "**/.env*", ".venv", "venv", "*.pem", "*.key", ".ray", "runs", "data",
    ".git", "**/__pycache__", "*.egg-info", ".ruff_cache", ".pytest_cache", "build", "dist",
]  # fmt: skip


class JobError(Exception):
    """Something the user can fix, said in one line."""


def job_address(address: str | None) -> str:
    env = os.environ.get("RAY_ADDRESS", "")
    return address or (env if env.startswith(("http://", "https://")) else DEFAULT_ADDRESS)


def auth_headers() -> dict[str, str]:
    token = os.environ.get("RAY_AUTH_TOKEN", "")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")).expanduser()
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def connect(address: str | None) -> JobSubmissionClient:
    url = job_address(address)
    try:
        return JobSubmissionClient(url, headers=auth_headers())
    except AuthenticationError:
        raise JobError(
            f"the cluster at {url} requires its Ray auth token: put it in ~/.ray/auth_token "
            "(or RAY_AUTH_TOKEN); cluster.yaml's nodes use the token file_mounts copied there"
        ) from None
    except ConnectionError:
        raise JobError(
            f"cannot reach the Ray job API at {url}: is the cluster up? For cluster.yaml run "
            "`ray dashboard cluster.yaml` in another terminal; for the local twin `python -m cluster up --local`"
        ) from None


def check_config(kind: str, config: str, overrides: list[str]) -> None:
    """Validate the job's config here, before anything is uploaded; ConfigError names the problem."""
    path = Path(config)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"--config: no file {config}")
        if not path.resolve().is_relative_to(REPO):
            raise ConfigError(f"--config: {config} is outside {REPO}, the directory uploaded as the job's working_dir")
    if kind == "train":
        from train.config import load_config

        load_config(config, overrides)
    elif kind == "tune":
        from tune.config import load_sweep_config

        load_sweep_config(config, overrides)
    else:
        from serve.config import load_serve_config

        load_serve_config(config, overrides)


def entrypoint(kind: str, config: str, overrides: list[str]) -> str:
    path = Path(config)
    if path.suffix in (".yaml", ".yml"):
        config = str(path.resolve().relative_to(REPO))  # the job runs in the uploaded copy of the repo
    words = ["python", "-m", kind, "--config", config]
    for item in overrides:
        words += ["--set", item]
    return shlex.join(words)


def submit(kind: str, config: str, overrides: list[str], address: str | None, env: dict[str, str]) -> str:
    """Check the config, then submit; the job id."""
    if kind not in KINDS:
        raise JobError(f"unknown job kind {kind!r}; one of {list(KINDS)}")
    check_config(kind, config, overrides)
    env = {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S), **env}  # read by the job's supervisor actor
    client = connect(address)
    deadline = time.time() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(
                entrypoint=entrypoint(kind, config, overrides),
                runtime_env={"working_dir": str(REPO), "excludes": EXCLUDES, "env_vars": env},
                metadata={"raywright_kind": kind},
            )
        except RuntimeError as exc:
            # A cluster that just started answers before its job agent is up: wait for it a little.
            if "No available agent" not in str(exc) or time.time() > deadline:
                raise
            time.sleep(2)
