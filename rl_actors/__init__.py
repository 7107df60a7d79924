"""Ray actors: thin stateful shells (a model, an optimizer, an engine) around primitives.

One file per role: ``generator`` (GeneratorWorker), ``reference`` (RefLogprobWorker),
``reward`` (RewardWorker), ``trainer`` (TrainerWorker, one DeepSpeed rank). The classes are
plain Python; ``cluster.ray_wing.groups`` wraps them with ``ray.remote`` and places them.
"""
