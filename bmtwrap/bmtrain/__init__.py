"""BMTrain's API on bmtwrap's engine: what ``import bmtwrap as bmt`` gives a BMTrain program.

Thin classes and helpers over ``bmtwrap.engine``; they import the engine and ``bmtwrap.ops``, never the
reverse (BMTrain's ``save``/``load`` live in ``bmtwrap.checkpoint``, which the top level exports):

    block.py         Block / CheckpointBlock
    blocklist.py     TransformerBlockList
    pipeline.py      PipelineTransformerBlockList: pipeline parallelism (init_distributed(pipe_size=P))
    module.py        DistributedModule (the root of a hand-written model), init_parameters
    initializer.py   ParameterInitializer
    config_view.py   bmt.config, a read-only view of the DistContext
    distributed.py   autograd-aware collectives (bmt.distributed)
    zero_context.py  ZeroContext
    inspect/         inspect_model, inspect_tensor/record_tensor, format_summary
    nn/              bmt.nn.Linear / OpLinear (DistributedModule layers); the tensor-parallel names refuse
    nccl.py          BMTrain's NCCL entry points: refusals naming torch.distributed's
    utils.py         print_block, print_dict, see_memory, AverageRecorder
    debug.py         bmt.debug's store
    compat.py        install_bmtrain_alias(): ``import bmtrain`` resolves to bmtwrap's objects
    __main__.py      ``python -m bmtwrap.bmtrain program.py``: run a BMTrain program unchanged
"""
