"""The PD simulator: the engine's scheduler, page pools, instance step boundary and PD policy run in
virtual time against a cost model (simulator.py), on synthetic traces (traces.py). Cost models (cost.py):
an 8xH200 roofline, or one fitted to the real engine's measured steps by calibrate.py, which also checks
its predictions against the engine. `python -m ernie_jax.sim`, `python -m ernie_jax.sim.calibrate`.
"""
