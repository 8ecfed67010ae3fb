"""Every shell command in the README runs here as written (a long one with a step limit), or says why not.

A README command that is neither run nor excused fails ``test_every_readme_command_is_run_or_excused``,
so an example cannot rot unnoticed.
"""

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEP_LIMIT = " --set optim.max_steps=4 --set optim.warmup_steps=2 --set run.eval_every=4 --set checkpoint.every_steps=4"
# A sweep's limit: two trials of 20 steps (its `set` list replaced whole).
SWEEP_LIMIT = (
    " --set 'set=[optim.max_steps=20, optim.warmup_steps=5, run.eval_every=10, checkpoint.every_steps=10]'"
    " --set num_trials=2"
)
RUN, STEPS = "as written", "with a step limit"
NEEDS_CLUSTER = "needs a Ray cluster on AWS (cluster.yaml); the job CLI is tested on the local twin (test_cluster.py)"

# README command -> RUN, STEPS, or the reason it is not run here. In README order: later commands use earlier runs.
HOW = {
    "pip install torch==2.13.0 && pip install -e . && python -m train": STEPS,  # the install is this environment's
    "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest": "the suite itself (.ci/run)",
    "python -m train --config small": "needs 4 GPUs; without them it is one line, exit 2 (test_cli.py)",
    "python -m train --config tiny --set optim.lr=1e-3 --set deepspeed.zero_stage=3 --set run.name=tiny-zero3": STEPS,
    "python -m train --config tiny --print-config": RUN,
    "python -m train --help": RUN,
    "python -m train.data prepare --source 'corpus/**/*.txt' --out data/mine --seq-len 256": RUN,
    "python -m train.data prepare --source s3://bucket/docs.parquet --text-column body --out s3://bucket/prepared": (
        "needs an S3 bucket"
    ),
    "python -m train --set data.tokenizer=bpe --set data.vocab_size=8192 --set run.name=tiny-bpe": STEPS,
    "python -m train": STEPS,  # command 1 again, where the Hugging Face section starts: trained already, it says so
    'python -c "\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\nmodel = AutoModelForCausalLM.'
    "from_pretrained('runs/tiny/export')\ntokenizer = AutoTokenizer.from_pretrained('runs/tiny/export')\nids = "
    "tokenizer('def main(', return_tensors='pt').input_ids\nprint(tokenizer.decode(model.generate(ids, "
    'max_new_tokens=20, do_sample=False)[0]))"': RUN,
    "python -m train.export_checkpoint runs/tiny": RUN,
    "python -m train --set model.init_from=runs/tiny/export --set run.name=finetune --set optim.max_steps=20": STEPS,
    "python -m serve --checkpoint runs/tiny": RUN,  # in the background, for the curl below
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' "
    '-d \'{"prompt": "def main(", "max_tokens": 64, "temperature": 0}\'': RUN,
    "python -m tune --config tiny": STEPS,  # its trials ask for `spot`: on a local Ray, one warning
    "python -m tune --resume runs/sweeps/tiny": RUN,  # a finished sweep: its summary, no Ray (test_tune.py kills one)
    "python -m train --config runs/sweeps/tiny/best-tiny.yaml": STEPS,
    'mkdir -p ~/.ray && python -c "import secrets; print(secrets.token_hex(32))" > ~/.ray/auth_token '
    "&& chmod 600 ~/.ray/auth_token": "writes the user's Ray token",
    "ray up cluster.yaml": NEEDS_CLUSTER,
    "ray dashboard cluster.yaml &": NEEDS_CLUSTER,
    "python -m cluster submit train --config small --set run.storage_path=s3://bucket/raywright --follow": (
        NEEDS_CLUSTER
    ),
    "python -m cluster list | status JOB | logs JOB --follow | stop JOB": NEEDS_CLUSTER,
    "serve deploy serve/deploy.yaml": NEEDS_CLUSTER,
    "ray down cluster.yaml": NEEDS_CLUSTER,
}


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks: comments dropped, continued and quoted lines joined."""
    commands, pending = [], ""
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if pending.count('"') % 2 == 0:  # outside a quoted python -c: drop the comment
                line = re.split(r"\s+# ", line)[0]
            line = line.split("   # pip install")[0]
            pending = f"{pending}\n{line}" if pending.count('"') % 2 else f"{pending} {line.strip()}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
            elif pending.count('"') % 2 == 0:
                commands.append(pending)
                pending = ""
    return commands


@pytest.mark.unit
def test_every_readme_command_is_run_or_excused():
    commands = readme_commands()
    assert len(commands) > 20
    assert [c for c in commands if c not in HOW] == [], "say in HOW how a new README command is tested"
    assert [c for c in HOW if c not in commands] == [], "a command left the README: drop it from HOW"


@pytest.mark.unit
def test_the_layout_names_every_module_and_no_other():
    """The README's Layout is where a reader looks for a module: one added, renamed or removed updates it."""
    layout = re.search(r"## Layout\n\n```\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    listed, package = set(), None
    for line in layout.splitlines():
        if not line.startswith(" "):
            package = line.split("/")[0]
        listed |= {f"{package}/{name}" for name in re.findall(r"(?<![\w/])(\w+\.py)\b", line)}
    modules = {
        f"{package}/{path.name}"
        for package in ("train", "serve", "tune", "cluster")
        for path in (REPO / package).glob("*.py")
        if path.name != "__init__.py"
    }
    assert sorted(modules - listed) == [], "name these modules in the README's Layout"
    assert sorted(listed - modules) == [], "the README's Layout names modules that are not there"


def _shell(command: str, cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    if command.startswith("pip install"):  # this environment is that install
        command = command.split(" && ")[-1]
    if HOW[command] == STEPS:
        command += SWEEP_LIMIT if command.startswith("python -m tune") else STEP_LIMIT
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    return done


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM (kill, docker stop), not Ctrl-C's SIGINT, which a shell starting pytest in the background leaves
    ignored. The server shuts down Serve and the Ray it started."""
    server.send_signal(signal.SIGTERM)
    try:
        assert server.wait(timeout=60) == 0  # stopped cleanly (killed by the signal it would be -15)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # whatever it left


@pytest.mark.cluster
def test_readme_commands_run_as_written(tmp_path):
    """In README order, in one directory, each on its own private Ray as a user's laptop would run them."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    corpus = tmp_path / "corpus" / "notes"
    corpus.mkdir(parents=True)
    for i in range(20):
        (corpus / f"note{i}.txt").write_text(f"Note {i}: the quick brown fox jumps over the lazy dog.\n" * 40)
    server = None
    try:
        for command in readme_commands():
            if HOW[command] not in (RUN, STEPS):
                continue
            if command.startswith("python -m serve"):
                server = subprocess.Popen(shlex.split(command), cwd=tmp_path, env=env, start_new_session=True)
                continue
            if command.startswith("curl"):
                deadline = time.time() + 180
                while subprocess.run(["curl", "-sf", "localhost:8000/ready"], capture_output=True).returncode:
                    assert server.poll() is None and time.time() < deadline, "python -m serve did not come up"
                    time.sleep(2)
            done = _shell(command, tmp_path, env)
            if command.startswith("curl"):
                assert '"text"' in done.stdout, done.stdout
                stopping, server = server, None
                _stop(stopping)  # its Ray would share the cores with the commands after it
            if command.split(" && ")[-1].startswith(("python -m train", "python -m tune")):
                # No DeepSpeed warning: none about the GPU a CPU machine lacks, none about tensor parallelism.
                assert "] [WARNING] [" not in done.stdout, done.stdout
            if command == "python -m train --help":
                assert "optim.lr  (float" in done.stdout
            if command == "python -m train":  # the run of command 1, finished: not started again
                assert "'tiny' is already trained to step 4 and exported; nothing to train" in done.stdout
                assert "Started a local Ray" not in done.stderr, done.stderr
            if command == "python -m tune --config tiny":  # no node of a local Ray has `spot`: dropped, said once
                warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: trial_resources")]
                assert len(warnings) == 1 and "'spot'" in warnings[0], warnings
                assert "max_concurrent_trials" not in done.stderr, done.stderr  # Tune's, were both limits given
                assert f"best recipe: {tmp_path}/runs/sweeps/tiny/best-tiny.yaml" in done.stdout
            if command == "python -m tune --resume runs/sweeps/tiny":  # finished: its summary, without a Ray
                assert "best recipe:" in done.stdout and "Started a local Ray" not in done.stderr, done.stderr
    finally:
        if server is not None:
            _stop(server)
    assert (tmp_path / "data" / "mine" / "manifest.json").is_file()
    assert (tmp_path / "runs" / "finetune" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "best-tiny" / "export" / "model.safetensors").is_file()
