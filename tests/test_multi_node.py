"""Several torchrun agents, as on several machines: two agents of two processes each meet through a c10d
rendezvous on localhost (gloo). Spanning two nodes, they shard inside each node and replicate across
(hybrid sharding, the default then), and train exactly as one agent with four processes does with
shard_size=2: a wrapped model in a loop of the program's own, and bmtwrap.hf.Trainer."""

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launch import ROOT, TESTS, _free_port, run_job

SCRIPT = TESTS / "dist_cases" / "multi_node.py"


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))


def _torchrun(*options):
    return [sys.executable, "-m", "torch.distributed.run", *options]


def _two_agents(nproc: int, *program: str) -> None:
    """``program`` under two torchrun agents of ``nproc`` processes each, as on two machines: the same command on
    every "node", the c10d rendezvous on localhost assigning the node ranks."""
    command = _torchrun("--nnodes=2", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=multi-node-test", *program)
    agents = [subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(o[-4000:] for o in outputs)


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        one, two = Path(tmp) / "one.json", Path(tmp) / "two.json"
        # The one-agent reference launched as the other tests' jobs are (ranks forked with torchrun's environment,
        # see tests/launch.py): the two agents' run is what is tested; this saves five imports of torch.
        returncode, output = run_job("multi_node.py", 4, one, (), timeout=600, env={"BMTWRAP_SHARD_SIZE": "2"})
        assert returncode == 0, output[-6000:]
        _two_agents(2, str(SCRIPT), str(two))
        yield json.loads(one.read_text()), json.loads(two.read_text())


def test_two_agents_train_exactly_like_one(runs):
    one, two = runs
    assert two["train"]["losses"] == one["train"]["losses"]
    assert two["train"]["digest"] == one["train"]["digest"]


def test_the_trainer_runs_unchanged_across_two_agents(runs):
    """bmtwrap.hf.Trainer joins the job itself: across two agents it logs the losses and ends with the parameters of
    one agent with the same layout."""
    one, two = runs
    assert len(one["trainer"]["losses"]) == 4 and all(math.isfinite(x) for x in one["trainer"]["losses"])
    assert two["trainer"] == one["trainer"]


def test_two_agents_form_one_world_of_two_nodes(runs):
    one, two = runs
    assert two["where"]["shard_size"] == 2, "spanning two nodes, parameters are sharded inside each by default"
    assert one["where"]["shard_size"] == 2 and two["where"]["zero_rank"] == 0
    ranks = two["where"]["ranks"]
    assert [r[0] for r in ranks] == [0, 1, 2, 3]
    assert sorted((r[2], r[1]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # (node, local rank)


def test_the_finetune_example_runs_unchanged_across_two_agents(tmp_path):
    """examples/finetune_hf.py under two agents of one process each: each "machine" holds a replica (shard groups
    of its one rank), and it logs the same losses as one agent of two processes with BMTWRAP_SHARD_SIZE=1."""
    example = str(ROOT / "examples" / "finetune_hf.py")
    quick = ["--steps", "4", "--save-every", "0", "--eval-batches", "1", "--seq", "64", "--batch", "4",
             "--sample-tokens", "8"]
    # The reference launched as the fixture's is (ranks forked with torchrun's environment, see tests/launch.py): the
    # two agents' run is what is tested; this saves an agent's and two ranks' imports of torch and transformers.
    returncode, output = run_job(example, 2, None, (*quick, "--out", str(tmp_path / "one")), timeout=600,
                                 env={"BMTWRAP_SHARD_SIZE": "1"})
    assert returncode == 0, output[-6000:]
    _two_agents(1, example, *quick, "--out", str(tmp_path / "two"))

    def losses(out):
        return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
                if "loss" in r]

    assert losses(tmp_path / "two") == losses(tmp_path / "one") and len(losses(tmp_path / "one")) >= 4
