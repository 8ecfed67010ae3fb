"""The one-process group of a DeepSpeed engine outside Ray Train (a sweep trial, an export) leaves nothing behind."""

import ast
import os
import subprocess
import sys

import pytest

# In a process of its own: the test process may hold the session's group already.
SCRIPT = """
import os
import torch.distributed as dist
from train.process_group import one_process_group

os.environ["MASTER_PORT"] = "the user's"
with one_process_group(use_gpu=False):
    assert dist.get_world_size() == 1 and (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("0", "0")
print({name: os.environ.get(name) for name in {names}}, dist.is_initialized())
"""
NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.mark.unit
def test_the_group_and_its_launcher_variables_are_gone_after_the_block():
    env = {name: value for name, value in os.environ.items() if name not in NAMES}  # the session group's LOCAL_RANK
    script = SCRIPT.replace("{names}", repr(NAMES))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    left, initialized = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    expected = {"MASTER_ADDR": None, "MASTER_PORT": "the user's", "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None}
    assert ast.literal_eval(left) == expected and initialized == "False"
