"""A long run interrupted by crashes resumes to the very same parameters (world size 3, gloo).

150 steps with dropout, bmtwrap's Adam, a cosine schedule and an OptimManager. The interrupted run
saves a sharded checkpoint every 25 steps; 7 steps after each save one rank is killed with SIGKILL in
the middle of a step (its forward done, its backward not); the job is started again from the
checkpoint. After 150 steps every parameter equals, bit for bit, the parameters of a run that was
never interrupted, and so do the losses of the steps after the last restart. Five crashes and
restarts, each from a checkpoint with another schedule position, optimizer step and dropout state:
what 50 steps between them would add is more of the same steps.
"""

import json

from launch import run_cases, run_job

WORLD = 3
STEPS = 150
EVERY = 25


def test_save_kill_restart_load_every_25_steps_is_bit_exact(tmp_path):
    straight = run_cases("soak.py", WORLD, str(tmp_path / "unused"), str(STEPS), timeout=600)
    folder = tmp_path / "ckpt"
    for start in range(0, STEPS - EVERY, EVERY):
        args = [str(folder), str(STEPS), "--save-every", str(EVERY), "--die-at", str(start + EVERY + 7)]
        returncode, output = run_job("soak.py", WORLD, tmp_path / "killed.json",
                                     tuple(args + (["--resume"] if start else [])), timeout=600)
        assert returncode != 0, f"the run from step {start} was to be killed at step {start + EVERY + 7}"
        assert "SIGKILL" in output or "-9" in output, output[-3000:]
        assert not (tmp_path / "killed.json").exists()
        index = json.loads((folder / "index.json").read_text())
        assert index["step"] == start + EVERY, "the checkpoint of the killed run is not the last complete one"
    last = run_cases("soak.py", WORLD, str(folder), str(STEPS), "--resume", timeout=600)
    assert last["start"] == STEPS - EVERY
    assert last["losses"] == straight["losses"][-EVERY:], "the losses after the last restart differ"
    differ = [k for k, v in straight["digest"].items() if last["digest"][k] != v]
    assert not differ, f"parameters differ after {STEPS} steps: {differ}"
