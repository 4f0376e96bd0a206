"""The JAX machinery every layer shares, below all of them.

* ``jaxprs``: the one module that reads and re-binds JAX's jaxprs;
* ``stateful_call``: tracing a call whose inputs hold Flax NNX modules and optimizers;
* ``leaves``: which leaves of a tree are floating, and matching gradients to parameters;
* ``validation``: checking a user's arguments, with errors that name the bad value.

Nothing here imports a layer (``core``, ``transform``, ``facade``, ``casting``,
``diagnosis``), optax or flax; every layer may import from here. Nothing here is
jaxscale's API.
"""
