"""Pure GPR policy core: plain data in, decisions out; no I/O and no clock reads (time is passed in).

Modules: :mod:`gpr` (request model and life cycle), :mod:`inventory` (nodes, devices, allocations),
:mod:`queue` (ordering), :mod:`placement` (best-fit, FGD, random), :mod:`eviction` (victim planning),
:mod:`waittime` (estimated start), :mod:`scheduler` (the engine that ties them together).
"""
