"""The engine: sharded parameters, their gathers and reductions, blocks' runs and the run-time state.

Nothing here knows of the BMTrain API (``bmtwrap.bmtrain``) or the front ends (``wrap``, ``optim``,
``checkpoint``, ``hf``, ...): they import the engine, never the reverse (``tests/test_layering.py``).
Its modules, each importing only those listed above it (and ``bmtwrap.ops``, the compiled kernels):

    watchdog.py      heartbeats in the job's store: a failed collective names the rank at fault
    dist.py          DistContext: the process group, device and copy streams of this process
    param.py         DistributedParameter and the shard arithmetic (FlatLayout, LocalPiece)
    collectives.py   all-gather, reduce-scatter, all-reduce: one free function each
    offload.py       what a flat buffer keeps on the host, and the host memory it lives in
    memory.py        sizes ("24GiB"), the GPU memory gauge, and what an out-of-memory step says
    group.py         the communication unit: flat buffers, ShardState, gather/release/reduce-scatter
    on_demand.py     a forward's torch-function mode: a block's parameter used outside it is gathered
    shard.py         sharding a module's parameters into a group (build_group, lone_group)
    schedule.py      the Engine (per-process run-time state, TrainingState, reductions in flight) and
                     the Schedule: execution order, prefetch policy, in-flight reduction bound
    runners.py       BlockRunner (a module run as a block), RootRunner (the root group around a
                     forward), BlockModule (the mark of a module that holds its own runner)
    full_state.py    full-shaped state: the load hook, full_state_dict, full_grad_dict
"""
